"""The critic of GAE runs: a value head on the policy model's final-norm hidden state, beside its own
LoRA adapter "critic" on the same frozen base (``rl.train.trainer``)."""

from __future__ import annotations

import torch


class ValueHead(torch.nn.Module):
    """V(s_t) = w · h_t + b on the final-norm hidden state [s, b, H] -> [s, b] (fp32, replicated)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.proj.weight)
        torch.nn.init.zeros_(self.proj.bias)

    def forward(self, h):
        return self.proj(h.float()).squeeze(-1)

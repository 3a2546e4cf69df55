"""``RolloutBatch``: one step's samples as padded [B, R] tensors (B samples, R = longest response).

Samples are ordered by (prompt, sample index); ``uid`` is the prompt's position in the step, the
group index verl's GRPO/RLOO estimators normalise within.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

@dataclass
class RolloutBatch:
    prompts: list[list[int]]
    responses: list[list[int]]
    uid: np.ndarray
    response_mask: torch.Tensor
    rollout_log_probs: torch.Tensor
    scores: torch.Tensor = None
    old_log_probs: Optional[torch.Tensor] = None
    ref_log_probs: Optional[torch.Tensor] = None
    values: Optional[torch.Tensor] = None
    advantages: Optional[torch.Tensor] = None
    returns: Optional[torch.Tensor] = None
    token_level_rewards: Optional[torch.Tensor] = None
    rollout_is_weights: Optional[torch.Tensor] = None
    routes: Optional[list] = None
    """R3: per sample the engine's experts, uint8 [len(prompt) + len(response) - 1, moe_layers, top_k]."""
    index_topk: Optional[list] = None
    """Per sample the engine's DSA top-k of sampled query rows (``Result.index_topk``) or None."""

    @property
    def size(self) -> int:
        return len(self.responses)

    @staticmethod
    def build(prompts: list[list[int]], responses: list[list[int]], logprobs: list[list[float]],
              uid: list[int]) -> "RolloutBatch":
        B, R = len(responses), max(1, max(len(r) for r in responses))
        mask = torch.zeros(B, R)
        lp = torch.zeros(B, R)
        for i, (r, l) in enumerate(zip(responses, logprobs)):
            mask[i, : len(r)] = 1.0
            lp[i, : len(l)] = torch.tensor(l, dtype=torch.float32)
        return RolloutBatch(prompts, responses, np.asarray(uid), mask, lp)

    def set_rows(self, key: str, rows: dict[int, torch.Tensor]) -> None:
        """Fill [B, R] tensor ``key`` from per-sample rows {sample index: [len(response)]}."""
        t = torch.zeros_like(self.response_mask)
        for i, row in rows.items():
            t[i, : row.numel()] = row
        setattr(self, key, t)

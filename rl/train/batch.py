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


def make_batch(prompts, results, n: int) -> RolloutBatch:
    """The padded batch of a step's samples: ``prompts`` (each with ``ids``) × ``n`` samples each, ``results``
    the engines' ``rl.rollout.base.Result`` in (prompt, sample) order. Observation tokens of tool episodes
    (a result's ``mask``: 0 on tool output) are out of ``response_mask``; R3's routes and the engines' DSA
    top-k travel along when the results carry them."""
    batch = RolloutBatch.build([p.ids for p in prompts for _ in range(n)], [r.response_ids for r in results],
                               [r.logprobs for r in results], [j for j, _ in enumerate(prompts) for _ in range(n)])
    for i, r in enumerate(results):
        if r.mask is not None:
            batch.response_mask[i, : len(r.mask)] *= torch.tensor(r.mask, dtype=batch.response_mask.dtype)
    if results and all(getattr(r, "routes", None) is not None for r in results):
        batch.routes = [r.routes for r in results]  # R3 (rl.train.routing)
    if any(getattr(r, "index_topk", None) is not None for r in results):
        batch.index_topk = [r.index_topk for r in results]
    return batch


def fill_log_probs(batch: RolloutBatch, outputs: list[dict]) -> None:
    """Put the trainer ranks' old / ref log-probs and values ([n, R] rows, ``outputs[k]["rows"]`` naming the
    samples) into ``batch``."""
    for key in ("old_log_probs", "ref_log_probs", "values"):
        rows = {}
        for out in outputs:
            if len(out[key]):
                for i, row in zip(out["rows"], out[key]):
                    rows[i] = row[: len(batch.responses[i])]
        if rows:
            batch.set_rows(key, rows)

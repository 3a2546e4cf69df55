"""A step's samples scored, for the driver and the step sources: each response decoded with the run's tokenizer
and scored by ``rl.tasks.rewards.RewardScorer`` against its prompt's ground truth, the failures counted.

Apart from ``rl.tasks.rewards`` because it needs torch (the [N] score tensor) and the reward worker processes
import that module for the built-in functions: each worker starts without importing torch."""

from __future__ import annotations

import torch

from rl.tasks.rewards import RewardScorer


class Rewards:
    """A step's samples scored: each response decoded with ``tokenizer`` and scored by ``RewardScorer``
    against its prompt's ground truth; ``rewards(prompts, results, n)`` -> [len(prompts) * n] float32.
    ``metrics`` sums ``reward/timeouts`` and ``reward/errors`` since the last ``take_metrics``, ``events``
    names the failed samples."""

    def __init__(self, cfg, tokenizer):
        self.scorer, self.tok = RewardScorer(cfg.reward), tokenizer
        self.metrics = {"reward/timeouts": 0.0, "reward/errors": 0.0}
        self.events: list[str] = []

    def __call__(self, prompts, results, n: int) -> torch.Tensor:
        rows = [p for p in prompts for _ in range(n)]
        text = [self.tok.decode(r.response_ids, skip_special_tokens=True) for r in results]
        scores, counts, events = self.scorer.score([p.data_source for p in rows], text,
                                                   [p.ground_truth for p in rows], [p.extra for p in rows])
        for k, v in counts.items():
            self.metrics[k] += v
        self.events += events
        return torch.tensor(scores)

    def take_metrics(self) -> dict:
        out, self.metrics = self.metrics, {k: 0.0 for k in self.metrics}
        return out

    def close(self) -> None:
        self.scorer.close()

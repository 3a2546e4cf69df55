"""DAPO batch shaping (arXiv 2503.14476; verl's DAPO recipe keys): dynamic sampling and overlong handling.

- ``overlong_penalty``: the soft overlong punishment of ``reward.overlong_buffer`` — 0 up to
  ``max_new_tokens - len`` tokens, then linear down to ``-penalty_factor`` at the budget (verl's
  ``DAPORewardManager`` formula).
- ``uniform_groups``: which prompt groups have the same ``algorithm.filter_groups.metric`` for every
  sample (std 0: GRPO's advantage is 0 there, so they only dilute the batch).
- ``GroupFilter``: keeps the non-uniform groups of successive generation rounds until the step's batch
  is full, with verl's ``filter_groups`` metrics.
- ``mask_truncated``: DAPO's overlong filtering (``algorithm.mask_truncated_responses``): responses cut
  by the token budget carry no loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def overlong_penalty(lengths: torch.Tensor, max_new_tokens: int, buffer_len: int, factor: float) -> torch.Tensor:
    """[B] response lengths -> [B] penalties ``min(-(L - (max_new - len)) / len · factor, 0)``."""
    exceed = lengths.float() - (max_new_tokens - buffer_len)
    return torch.clamp(-exceed / buffer_len * factor, max=0.0)


def uniform_groups(metric: torch.Tensor, n: int) -> torch.Tensor:
    """[G·n] per-sample metric (samples of a group adjacent) -> [G] bool: all n values equal."""
    g = metric.view(-1, n)
    return (g == g[:, :1]).all(dim=1)


def shape_scores(cfg, raw: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Rewards after the overlong penalty (``batch.scores``) and its metrics."""
    ob = cfg.reward.overlong_buffer
    if not ob.enable:
        return raw, {}
    pen = overlong_penalty(lengths, cfg.rollout.max_new_tokens, ob.len, ob.penalty_factor)
    m = {}
    if ob.log:
        m = {"overlong/penalty_mean": float(pen.mean()), "overlong/penalized_fraction": float((pen < 0).float().mean())}
    return raw + pen, m


@dataclass
class GroupFilter:
    """Collects one step's groups over generation rounds. ``add`` takes a round's prompts, results and
    [len(prompts)·n] raw / shaped scores; ``full`` says whether ``want`` groups are kept; ``take`` returns
    the step's groups (the first ``want`` kept, topped up with dropped ones if the round limit ended
    collection early) and the metrics."""

    want: int
    n: int
    metric: str = "score"
    enable: bool = True
    rounds: int = 0
    kept: list = field(default_factory=list)
    dropped: list = field(default_factory=list)

    def add(self, prompts: list, results: list, raw: torch.Tensor, shaped: torch.Tensor) -> None:
        self.rounds += 1
        metric = raw if self.metric == "score" else shaped
        same = uniform_groups(metric, self.n) if self.enable else torch.zeros(len(prompts), dtype=torch.bool)
        for j, p in enumerate(prompts):
            sl = slice(j * self.n, (j + 1) * self.n)
            (self.dropped if same[j] else self.kept).append((p, results[sl], raw[sl], shaped[sl]))

    @property
    def full(self) -> bool:
        return len(self.kept) >= self.want

    def take(self) -> tuple[list, list, torch.Tensor, torch.Tensor, dict]:
        groups = self.kept[: self.want]
        filled = max(0, self.want - len(groups))
        groups = groups + self.dropped[:filled]
        prompts = [g[0] for g in groups]
        results = [r for g in groups for r in g[1]]
        raw = torch.cat([g[2] for g in groups])
        shaped = torch.cat([g[3] for g in groups])
        m = {}
        if self.enable:
            m = {"filter_groups/num_gen_batches": float(self.rounds),
                 "filter_groups/kept_groups": float(len(self.kept)),
                 "filter_groups/dropped_groups": float(len(self.dropped)),
                 "filter_groups/surplus_groups": float(max(0, len(self.kept) - self.want)),
                 "filter_groups/filled_with_uniform": float(filled)}
        return prompts, results, raw, shaped, m


def mask_truncated(batch, results: list) -> dict:
    """Zero ``batch.response_mask`` rows of responses that hit the token budget (finish_reason "length").
    A step where every response is truncated is left unmasked (nothing would train) and says so in
    ``overlong/all_truncated``."""
    cut = torch.tensor([r.finish_reason == "length" for r in results])
    every = bool(cut.all())
    if not every:
        batch.response_mask[cut] = 0.0
    return {"overlong/masked_truncated_fraction": 0.0 if every else float(cut.float().mean()),
            "overlong/all_truncated": float(every)}

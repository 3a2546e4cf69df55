"""What async RL books about its samples (``rl.schedule.async_source``): the checkpoint ledger's slot ranges,
the staleness of a batch, the re-prefilled tokens of continued requests."""

from __future__ import annotations

import torch

from rl.rollout.base import Request, Result


def prefill_tokens(reqs: list[Request]) -> int:
    """Prompt + prefix tokens the engines prefill again for continued responses (``rollout/reprefill_tokens``)."""
    return sum(len(r.prompt_ids) + len(r.prefix_ids) for r in reqs if r.prefix_ids)


def ranges(ints) -> list[list[int]]:
    """Sorted ints as [[first, last], ...] runs (a checkpoint's ledger stays small)."""
    out: list[list[int]] = []
    for i in sorted(ints):
        if out and out[-1][1] == i - 1:
            out[-1][1] = i
        else:
            out.append([i, i])
    return out


def expand(runs) -> list[int]:
    return [i for a, b in runs for i in range(a, b + 1)]


def staleness_metrics(results: list[Result], version: int) -> dict:
    """``rollout/staleness`` (mean), ``_min``, ``_max`` over samples (trainer version − the sample's oldest
    token version) and ``rollout/staleness_tokens/<d>``: the histogram of token staleness (fractions)."""
    oldest = torch.tensor([version - min(r.versions) for r in results], dtype=torch.float32)
    tok = torch.tensor([version - v for r in results for v in r.versions], dtype=torch.long)
    out = {"rollout/staleness": float(oldest.mean()), "rollout/staleness_min": float(oldest.min()),
           "rollout/staleness_max": float(oldest.max()),
           "rollout/mixed_version_fraction": float(sum(len(set(r.versions)) > 1 for r in results) / len(results))}
    if tok.numel():
        counts = torch.bincount(tok.clamp(min=0))
        out.update({f"rollout/staleness_tokens/{d}": float(c) / tok.numel() for d, c in enumerate(counts.tolist())})
    return out

"""What async RL books about its samples (``rl.schedule.async_source``): a prompt group as it is generated, the
samples ahead of a new one (what admission bounds), the checkpoint ledger's slot ranges, the staleness of a
batch, the re-prefilled tokens of continued requests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional

import torch

from rl.rollout.base import Request, Result


@dataclass
class Group:
    """One prompt's ``n`` samples as they are generated."""
    g: int
    """Generation batch (the synchronous step whose prompts and seeds these are)."""
    order: int
    """Position of the prompt in its generation batch."""
    prompt: object
    done: dict = field(default_factory=dict)
    """sample index → finished ``Result`` (with ``versions``)."""
    partial: dict = field(default_factory=dict)
    """sample index → interrupted ``Result`` (prefix so far, with ``versions``)."""
    interrupts: int = 0
    raw: Optional[torch.Tensor] = None
    """[n] rewards once every sample is done and scored."""

    @property
    def key(self) -> tuple:
        return (self.g, self.order)


def samples_ahead(groups: Iterable[Group], n: int) -> int:
    """The samples a newly admitted group waits behind before the trainer takes it: every unfinished sample (to
    generate, in the engines' queue or slots) and every sample of a complete group (waiting for a take). The
    finished samples of an incomplete group do not count: they wait for their group's long sample, which
    finishes after a new group's typical one."""
    return sum(n if len(grp.done) == n else n - len(grp.done) for grp in groups)


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

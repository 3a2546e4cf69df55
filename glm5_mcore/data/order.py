"""The order documents / prompts are drawn in and how a step's work is cut into micro-batches: one
definition for SFT (``glm5_mcore.data.sft``, ``glm5_mcore.data.indexed``) and RL (``rl.tasks.prompts``, ``rl.train.trainer``).

- ``epoch_order``: the reproducible shuffle of an epoch (NumPy's generator seeded with
  ``[seed, epoch]``): the SFT jsonl path, Megatron indexed datasets and the RL prompt stream.
- ``greedy_packs``: consecutive items go into one micro-batch until the next would exceed the
  token budget (THD packing, no padding).
- ``equal_micro_batch_sizes``: every rank's micro-batch plan made the same — as many micro-batches
  as the rank with most, micro-batch i as long as the longest i-th one — since Megatron's allgather
  token dispatcher (EP) and pipeline stages need equal shapes across ranks; the caller pads with
  masked filler tokens.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np
import torch
import torch.distributed as dist

from glm5_mcore.device import training_device


def epoch_order(n: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled order of ``n`` items in ``epoch``: int64 [n], a permutation of range(n). NumPy's
    generator, so an epoch of 10^8 documents costs ~1 s and 8 bytes per document."""
    return np.random.default_rng([seed, epoch]).permutation(n)


def greedy_packs(lengths: Iterable[int], budget: int) -> Iterator[list[int]]:
    """The packing rule: consecutive items (positions in ``lengths``) go into one micro-batch until
    the next would exceed ``budget`` tokens. Lazy, so it also packs an unbounded stream."""
    cur, size = [], 0
    for i, n in enumerate(lengths):
        if cur and size + n > budget:
            yield cur
            cur, size = [], 0
        cur.append(i)
        size += n
    if cur:
        yield cur


def equal_micro_batch_sizes(sizes: list[int], group=None, fill: int = 1) -> list[int]:
    """This rank's micro-batch token counts ``sizes`` made equal over ``group`` (default: all ranks):
    the result has the largest count of any rank, entry i the largest i-th size (a rank with fewer
    micro-batches gets empty ones of ``fill`` tokens: 1, or a context-parallel split's unit). One rank:
    ``sizes`` unchanged."""
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return list(sizes)
    dev = training_device()
    count = torch.tensor([len(sizes)], device=dev)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=group)
    padded = torch.tensor(list(sizes) + [fill] * (int(count) - len(sizes)), dtype=torch.long, device=dev)
    dist.all_reduce(padded, op=dist.ReduceOp.MAX, group=group)
    return padded.tolist()

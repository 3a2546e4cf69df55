"""Context parallelism over THD packs: Megatron's load-balanced layout, one definition for SFT and RL.

Every document of a pack is padded (masked) to a multiple of 2·cp·m (m keeps the local length
divisible for sequence parallelism: the TP size, else 1) and cut into 2·cp chunks; CP rank r keeps
chunks r and 2·cp-1-r of every document (causal work balanced). ``cu_seqlens`` stay global (padded),
as Megatron's THD + CP code (rotary ``_apply_rotary_pos_emb_thd``, ``glm5_mcore.model.dsa``'s allgather CP)
expects.

- ``cp_shard``: one rank's share as an index map: each local token's position in the unsplit pack
  (-1 on padding), plus the padded ``cu_seqlens``.
- ``split_for_cp``: a packed batch (any dataclass with ``input_ids/labels/loss_mask/position_ids
  [1, T]`` and ``cu_seqlens``, e.g. ``glm5_mcore.data.sft.PackedBatch``) cut to one rank's share.
- ``cp_unsplit_index``: where each unsplit token lands in the all-gather of the ranks' shares;
  ``gather_from_cp`` uses it to put per-token results ([T_local, ...]) back in the unsplit order,
  differentiably: Megatron's ``gather_from_sequence_parallel_region`` with a split backward, so
  when every CP rank computes the same loss from the gathered tensor each rank's tokens get that
  loss's gradient once; Megatron's schedule multiplies a loss by the CP size and DDP averages over
  DP×CP, which gives CP 1's gradient.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass
class CPShard:
    index: torch.Tensor
    """long [T_local]: each local token's position in the unsplit pack; -1 on padding."""
    offset: torch.Tensor
    """long [T_local]: each local token's offset within its padded document."""
    padded_doc: torch.Tensor
    """bool [T_local]: the token's document got padding."""
    cu_seqlens: torch.Tensor
    """int32 [docs + 1]: the padded documents' global boundaries."""
    unsplit_of_padded: torch.Tensor
    """long [T_padded]: each padded-global position's position in the unsplit pack; -1 on padding (the
    key order of ``glm5_mcore.model.dsa``'s gathered keys)."""


def cp_shard(cu_seqlens, cp: int, rank: int, multiple: int = 1) -> CPShard:
    """Rank ``rank``'s share of a THD pack with document boundaries ``cu_seqlens`` (list or tensor); at
    cp 1 the whole pack, unpadded."""
    cu = [int(x) for x in (cu_seqlens.tolist() if torch.is_tensor(cu_seqlens) else cu_seqlens)]
    unit = 2 * cp * multiple if cp > 1 else 1
    index, offset, padded, out_cu, unsplit = [], [], [], [0], []
    for a, e in zip(cu[:-1], cu[1:]):
        n = e - a
        pad = -n % unit
        doc = torch.cat([torch.arange(a, e), torch.full((pad,), -1, dtype=torch.long)])
        c = (n + pad) // (2 * cp)
        keep = torch.cat([torch.arange(rank * c, (rank + 1) * c),
                          torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)]) if cp > 1 else torch.arange(n)
        index.append(doc[keep])
        offset.append(keep)
        padded.append(torch.full((keep.numel(),), bool(pad)))
        unsplit.append(doc)
        out_cu.append(out_cu[-1] + n + pad)
    cat = lambda xs, dt: torch.cat(xs) if xs else torch.zeros(0, dtype=dt)  # noqa: E731
    return CPShard(cat(index, torch.long), cat(offset, torch.long), cat(padded, torch.bool),
                   torch.tensor(out_cu, dtype=torch.int32), cat(unsplit, torch.long))


def split_for_cp(batch, cp: int, rank: int, pad_id: int = 0, tp: int = 1):
    """This context-parallel rank's share of a THD pack: ``cp_shard``'s tokens, padding with ``pad_id``
    (inputs and labels), loss mask 0 and positions continuing their document's; ``batch`` itself at cp 1."""
    if cp == 1:
        return batch
    sh = cp_shard(batch.cu_seqlens, cp, rank, tp)
    pad = sh.index < 0
    src = sh.index.clamp(min=0)
    take = lambda t, fill: t[0, src].masked_fill(pad, fill)[None]  # noqa: E731
    pos = torch.where(sh.padded_doc, sh.offset, batch.position_ids[0, src])[None]
    return dataclasses.replace(batch, input_ids=take(batch.input_ids, pad_id), labels=take(batch.labels, pad_id),
                               loss_mask=take(batch.loss_mask, 0), position_ids=pos, cu_seqlens=sh.cu_seqlens)


def cp_unsplit_index(cu_seqlens, cp: int, multiple: int = 1) -> torch.Tensor:
    """long [T]: for each token of the unsplit pack, its row in the concatenation (rank order) of the CP
    ranks' shares — what an all-gather along the token dimension returns."""
    shares = torch.cat([cp_shard(cu_seqlens, cp, r, multiple).index for r in range(cp)])
    real = shares >= 0
    out = torch.empty(int(real.sum()), dtype=torch.long)
    out[shares[real]] = torch.nonzero(real).squeeze(1)
    return out


def gather_from_cp(x: torch.Tensor, unsplit: torch.Tensor, group) -> torch.Tensor:
    """Per-token values ``x`` [T_local, ...] of every CP rank, in the unsplit order: [T, ...]
    (``unsplit`` from ``cp_unsplit_index``); differentiable (see the module docstring)."""
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    return gather_from_sequence_parallel_region(x, tensor_parallel_output_grad=False, group=group)[unsplit.to(x.device)]

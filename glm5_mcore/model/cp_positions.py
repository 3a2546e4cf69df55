"""Packed-THD positions under allgather context parallelism without a host read.

Megatron-Core's ``dsa_layout.build_packed_allgather_cp_query_positions_and_key_reorder`` (which this project's DSA
layer calls under CP > 1 with THD) drops empty documents and empty segments with boolean indexing
(``dsa_layout.py:248-251, 274-277``): a ``nonzero`` — a device-to-host sync — per call, so per DSA layer per
micro-batch. ``repeat_interleave`` with ``output_size`` already gives an empty segment no rows, so the same
positions follow without the filters; ``packed_cp_positions`` is that function, equal to Megatron-Core's on
every layout (``tests/model/test_cp_positions.py``) and free of host reads.

Layout (Megatron-Core's): each packed document of padded length L (a multiple of 2·cp) gives CP rank r its
front chunk ``[s + r·h, s + (r+1)·h)`` then its mirrored back chunk ``[e - (r+1)·h, e - r·h)``, h = L / (2·cp);
rows past the documents (padding) get positions after every real token, ``cu[-1] + r·rows + i``.
"""

from __future__ import annotations

import torch


def local_positions(cu_seqlens: torch.Tensor, cp: int, rank: int, rows: int) -> torch.Tensor:
    """int64 [rows]: the global packed position of each of CP rank ``rank``'s ``rows`` local tokens."""
    cu = cu_seqlens.to(torch.int64)
    dev = cu.device
    starts, ends = cu[:-1], cu[1:]
    half = (ends - starts) // cp // 2
    seg_starts = torch.stack((starts + rank * half, ends - (rank + 1) * half), 1).reshape(-1)
    seg_lens = torch.stack((half, half), 1).reshape(-1)
    pad = (torch.full((), rows, dtype=torch.int64, device=dev) - seg_lens.sum()).clamp_min(0)
    seg_starts = torch.cat((seg_starts, (cu[-1] + rank * rows).view(1)))
    seg_lens = torch.cat((seg_lens, pad.view(1)))
    seg = torch.repeat_interleave(torch.arange(seg_lens.numel(), device=dev), seg_lens, output_size=rows)
    first = torch.cumsum(seg_lens, 0) - seg_lens
    offset = torch.arange(rows, dtype=torch.int64, device=dev) - first.index_select(0, seg)
    return seg_starts.index_select(0, seg) + offset


def packed_cp_positions(cu_q: torch.Tensor, cu_kv: torch.Tensor, cp: int, rank: int,
                        rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's query positions [rows], the permutation [cp·rows] putting the rank-by-rank gathered keys in
    global packed order): Megatron-Core's ``build_packed_allgather_cp_query_positions_and_key_reorder``."""
    if cp <= 1:
        pos = torch.arange(rows, dtype=torch.int64, device=cu_q.device)
        return pos, pos
    if cu_q.device.type == "cpu":  # Megatron-Core's host-side guard, kept where it costs no device sync
        lens = cu_q[1:] - cu_q[:-1]
        bad = lens[lens % (2 * cp) != 0]
        if bad.numel():
            raise ValueError(f"packed DSA under CP: document length {int(bad[0])} is not a multiple of 2 x cp "
                             f"= {2 * cp} (the THD CP split pads each document to one)")
    q = local_positions(cu_q, cp, rank, rows)
    keys = torch.cat([local_positions(cu_kv, cp, r, rows) for r in range(cp)])
    return q, torch.argsort(keys)

"""The RL trainer's micro-batches: samples (prompt + response) THD-packed, the packing rule that gives
every rank the same number of micro-batches of the same sizes.

- ``PackedMicroBatch``: the documents of some samples back to back (``input_ids [1, T]``, ``targets [T]``,
  ``position_ids [1, T]``), ``pos [n, R]`` the logit position of each response token, a masked filler
  document up to ``pad_to``; R3 routes and the CP split (``rl.cp``) when asked.
- ``pack_micro_batches``: greedy packing of rows into ``micro_batch_tokens`` budgets, equal micro-batch
  sizes over ranks (Megatron's allgather dispatcher needs equal EP shares).
"""

from __future__ import annotations

import torch

from glm5_mcore.data.order import equal_micro_batch_sizes, greedy_packs
from glm5_mcore.model.build import packed_seq_params_from_lengths
from rl.batch import RolloutBatch
from rl.routing import pack_routes


class PackedMicroBatch:
    """Micro-batch: samples ``rows`` packed THD; ``pos`` [n, R] logit positions of each response
    token (its predecessor's position) in the unsplit pack. With context parallelism (``cp``, an
    ``rl.cp.RLContextParallel`` of size > 1) the tensors hold this CP rank's share (``rl.cp``) and
    ``pad_to`` counts the padded documents' tokens."""

    def __init__(self, batch: RolloutBatch, rows: list[int], pad_to: int, pad_id: int, route_shape=None, cp=None):
        ids, targets, positions, lengths = [], [], [], []
        R = batch.response_mask.shape[1]
        self.rows = rows
        self.pos = torch.zeros(len(rows), R, dtype=torch.long)
        off = 0
        for j, i in enumerate(rows):
            seq = batch.prompts[i] + batch.responses[i]
            P, n = len(batch.prompts[i]), len(batch.responses[i])
            ids += seq
            targets += seq[1:] + [0]
            positions += list(range(len(seq)))
            lengths.append(len(seq))
            self.pos[j, :n] = torch.arange(off + P - 1, off + P - 1 + n)
            off += len(seq)
        self.real_tokens = off
        self.pad_id = pad_id
        used = cp.padded_len(lengths) if cp is not None else off
        if pad_to > used:  # filler document (masked out) so EP ranks see equal token counts
            extra = pad_to - used
            ids += [pad_id] * extra
            targets += [0] * extra
            positions += list(range(extra))
            lengths.append(extra)
        self.num_tokens = len(ids)
        self.real_mask = torch.arange(self.num_tokens) < off  # the documents (not filler or CP padding)
        self.input_ids = torch.tensor([ids])
        self.targets = torch.tensor(targets)
        self.position_ids = torch.tensor([positions])
        self.lengths = lengths
        self.routes = self.routes_valid = None  # R3: [T, L, k] engine experts in this THD order (rl.routing)
        if batch.routes is not None and route_shape:
            self.routes, self.routes_valid = pack_routes(batch.routes, batch.prompts, batch.responses, rows,
                                                         self.num_tokens, *route_shape)
        self.unsplit = None  # CP: see rl.cp
        if cp is not None:
            cp.split(self)

    def packed_seq_params(self, device=None):
        return packed_seq_params_from_lengths(self.lengths, device)


def pack_micro_batches(batch: RolloutBatch, rows: list[int], micro_batch_tokens: int, pad_id: int, cp=None,
                       multiple: int = 1, route_shape=None) -> list[PackedMicroBatch]:
    """Greedy THD packing of ``rows`` into micro-batches of ``micro_batch_tokens``; with >1 rank every rank
    gets the same number of micro-batches of the same sizes (each rounded up to ``multiple``, the TP size
    under sequence parallelism). ``cp``: an ``rl.cp.RLContextParallel`` of size > 1, or None."""
    lengths = [len(batch.prompts[i]) + len(batch.responses[i]) for i in rows]
    packs = list(greedy_packs(lengths, micro_batch_tokens))
    own = [cp.padded_len([lengths[j] for j in g]) if cp is not None else sum(lengths[j] for j in g)
           for g in packs]  # CP: documents padded for the split
    sizes = equal_micro_batch_sizes(own, fill=cp.unit if cp is not None else 1)
    groups = [[rows[j] for j in g] for g in packs] + [[] for _ in range(len(sizes) - len(packs))]
    return [PackedMicroBatch(batch, g, -(-n // multiple) * multiple, pad_id, route_shape, cp)
            for g, n in zip(groups, sizes)]

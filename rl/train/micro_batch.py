"""The RL trainer's micro-batches: samples (prompt + response) THD-packed into token budgets, verl's
``use_dynamic_bsz`` rule, with every rank given the same number of micro-batches of the same sizes.

- ``plan_micro_batches``: a mini-batch's samples (their token counts ``[n]``) → ``[dp][k][rows]``: the
  samples balanced over the DP ranks by verl's workload estimate (Karmarkar-Karp, verl's
  ``_balance_batch``: equal sample counts where DP divides them), each rank's share cut into the fewest
  micro-batches that fit the budget, balanced (verl's ``rearrange_micro_batches``), the same count ``k`` on
  every rank (a rank with fewer samples than ``k`` gets empty filler micro-batches), largest first so
  micro-batch i is alike across ranks. Every rank holds the whole batch, so each computes every rank's
  plan, with no collective. A sample is never split: one longer than the budget is refused (``check_fits``).
- ``PackedMicroBatch``: the documents of some samples back to back (``input_ids [1, T]``, ``targets [T]``,
  ``position_ids [1, T]``), ``pos [n, R]`` the logit position of each response token, a masked filler
  document up to ``pad_to``; R3 routes and the CP split (``rl.train.cp``) when asked.
- ``pack_micro_batches``: this rank's micro-batches of the plan, each padded to the largest i-th one
  over ranks (Megatron's allgather dispatcher needs equal EP shares).

The loss does not depend on the split: verl's ``agg_loss`` divides by the *mini-batch's* token / sequence
counts (``global_batch_info``), so token-mean and seq-mean-token-mean are the same under any plan.
verl (and its ``tensordict``) are imported where used, as in ``rl.train.algos``.
"""

from __future__ import annotations

import torch

from glm5_mcore.data.order import equal_micro_batch_sizes
from glm5_mcore.model.build import packed_seq_params_from_lengths
from rl.train.batch import RolloutBatch
from rl.train.routing import pack_routes
from rl.train.verl_import import prepare as prepare_verl

prepare_verl()  # verl's math without Ray where Ray is not installed (the lent GPU image)


def sample_lengths(batch: RolloutBatch, rows: list[int], cp=None) -> list[int]:
    """Tokens each of ``rows`` takes in a pack: prompt + response, padded for the CP split (``rl.train.cp``)."""
    lengths = [len(batch.prompts[i]) + len(batch.responses[i]) for i in rows]
    return [cp.padded_len([n]) for n in lengths] if cp is not None else lengths


def check_fits(batch: RolloutBatch, rows: list[int], budget: int, field: str, cp=None) -> None:
    """A ValueError naming ``field`` and the sample when one of ``rows`` is longer than ``budget`` (a
    document is never split over micro-batches: attention needs all of it in one forward)."""
    for i, n in zip(rows, sample_lengths(batch, rows, cp)):
        if n > budget:
            pad = f", padded to {n} for the trainer.cp split" if cp is not None else ""
            raise ValueError(f"{field}={budget}: sample {i} has {len(batch.prompts[i])} prompt + "
                             f"{len(batch.responses[i])} response tokens{pad}; a sample is never split over "
                             f"micro-batches: raise {field} to at least {n} (with trainer.cp > 1 each rank holds "
                             "1/cp of a micro-batch) or lower rollout.max_new_tokens")


def dp_shares(lengths: list[int], dp: int) -> list[list[int]]:
    """Positions into ``lengths`` per DP rank, as verl's ``_balance_batch``: Karmarkar-Karp over verl's
    workload estimate (``calculate_workload``: linear + attention's quadratic term), each rank the same
    number of samples when ``dp`` divides them (sorted); round-robin when there are fewer samples than
    ranks (some ranks then only run fillers)."""
    from verl.utils.seqlen_balancing import calculate_workload, get_seqlen_balanced_partitions

    if dp == 1:
        return [list(range(len(lengths)))]
    if len(lengths) < dp:
        return [list(range(len(lengths)))[r::dp] for r in range(dp)]
    work = calculate_workload(torch.tensor(lengths, dtype=torch.long)).tolist()
    return get_seqlen_balanced_partitions(work, dp, equal_size=len(lengths) % dp == 0)


def _split(lengths: list[int], share: list[int], budget: int, at_least: int) -> list[list[int]]:
    """``share`` (positions into ``lengths``) cut by verl's ``rearrange_micro_batches``: at least
    ``at_least`` micro-batches (as many as there are samples at most), each within ``budget``; largest first."""
    from tensordict import TensorDict
    from verl.utils.seqlen_balancing import rearrange_micro_batches

    if not share:
        return []
    own = torch.tensor([lengths[j] for j in share])
    mask = torch.arange(int(own.max()))[None] < own[:, None]  # [n, L]: what verl reads a sample's length from
    td = TensorDict({"input_ids": mask, "attention_mask": mask}, batch_size=[len(share)])
    _, parts = rearrange_micro_batches(td, budget, min_num_micro_batch=min(at_least, len(share)) or None,
                                       use_dynamic_bsz_balance=False)
    parts = [[share[j] for j in p] for p in parts]
    return sorted(parts, key=lambda p: (-sum(lengths[j] for j in p), p))


def plan_micro_batches(lengths: list[int], budget: int, dp: int = 1) -> list[list[list[int]]]:
    """``[dp][k][positions into lengths]``: see the module doc. ``k`` is the largest count any rank needs
    (raised until every rank fits its share into ``k``)."""
    too_long = [n for n in lengths if n > budget]
    if too_long:
        raise ValueError(f"a sample of {max(too_long)} tokens exceeds the micro-batch budget {budget}")
    shares = dp_shares(lengths, dp)
    k, plans = 0, []
    while True:
        plans = [_split(lengths, s, budget, k) for s in shares]
        most = max(len(p) for p in plans)
        if most == k or dp == 1:
            break
        k = most
    k = max(len(p) for p in plans)
    return [p + [[] for _ in range(k - len(p))] for p in plans]


class PackedMicroBatch:
    """Micro-batch: samples ``rows`` packed THD; ``pos`` [n, R] logit positions of each response
    token (its predecessor's position) in the unsplit pack. With context parallelism (``cp``, an
    ``rl.train.cp.RLContextParallel`` of size > 1) the tensors hold this CP rank's share (``rl.train.cp``) and
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
        self.used_tokens, self.packed_tokens = used, max(pad_to, used)  # unsplit: documents (CP-padded), all
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
        self.routes = self.routes_valid = None  # R3: [T, L, k] engine experts in this THD order (rl.train.routing)
        if batch.routes is not None and route_shape:
            self.routes, self.routes_valid = pack_routes(batch.routes, batch.prompts, batch.responses, rows,
                                                         self.num_tokens, *route_shape)
        self.unsplit = None  # CP: see rl.train.cp
        if cp is not None:
            cp.split(self)

    def packed_seq_params(self, device=None):
        return packed_seq_params_from_lengths(self.lengths, device)


def pack_micro_batches(batch: RolloutBatch, rows: list[int], micro_batch_tokens: int, pad_id: int, cp=None,
                       multiple: int = 1, route_shape=None, dp: int = 1, dp_rank: int = 0) -> list[PackedMicroBatch]:
    """This DP rank's micro-batches of ``rows`` (the whole mini-batch, every rank's share) planned by
    ``plan_micro_batches`` within ``micro_batch_tokens``; micro-batch i padded to the largest i-th one of
    any rank (rounded up to ``multiple``, the TP size under sequence parallelism). ``cp``: an
    ``rl.train.cp.RLContextParallel`` of size > 1, or None."""
    lengths = sample_lengths(batch, rows, cp)
    plan = plan_micro_batches(lengths, micro_batch_tokens, dp)[dp_rank]
    own = [sum(lengths[j] for j in g) for g in plan]
    sizes = equal_micro_batch_sizes(own, fill=cp.unit if cp is not None else 1)
    groups = [[rows[j] for j in g] for g in plan] + [[] for _ in range(len(sizes) - len(plan))]
    return [PackedMicroBatch(batch, g, -(-max(n, 1) // multiple) * multiple, pad_id, route_shape, cp)
            for g, n in zip(groups, sizes)]

"""Context parallelism in the RL trainer (``trainer.cp``): each packed micro-batch is split over the CP
ranks as the SFT recipe splits it (``glm5_mcore.data.cp_split``: per-document load-balanced chunks, every
document padded to a multiple of 2·cp·m), and per-token results come back in the unsplit THD order, so
old / reference log-probs, values, losses and metrics are those of CP 1.

- ``RLContextParallel.padded_len``: a pack's token count once its documents are padded (what the
  trainer equalises across ranks, so EP ranks see equal local sizes).
- ``RLContextParallel.split``: a ``rl.train.micro_batch.PackedMicroBatch`` cut to this rank's tokens — inputs, targets,
  positions, the padded ``cu_seqlens``, and the R3 routes with the same index map (each CP rank
  replays the engine's experts of the tokens it holds; padding gets placeholder experts, not valid).
- ``RLContextParallel.gather``: per-token [T_local, ...] results of all CP ranks in the unsplit order
  [T, ...] (differentiable; every CP rank then computes the same loss over whole responses).
- ``RLContextParallel.sum``: counts (router / DSA top-k agreement, MoE load) summed over the CP group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from glm5_mcore.data.cp_split import cp_shard, cp_unsplit_index, gather_from_cp


def cp_unit(cp: int, multiple: int) -> int:
    """The length every document is padded to a multiple of under CP (``cp_split``'s 2·cp·m: two
    load-balanced chunks per rank, ``multiple`` = ``mcore_settings.token_multiple``); 1 at CP 1."""
    return 2 * cp * multiple if cp > 1 else 1


class RLContextParallel:
    def __init__(self, multiple: int, size: int | None = None, rank: int | None = None):
        """``multiple``: the local length multiple a rank needs (``mcore_settings.token_multiple``: the TP size under
        sequence parallelism, x 16 for TE's FP8); ``size`` / ``rank``: this rank's place in the CP group (default:
        Megatron's parallel state; given, no group: the packer alone, as the tests plan another rank's share)."""
        from megatron.core import parallel_state as ps

        given = size is not None
        self.size = size if given else ps.get_context_parallel_world_size()
        self.rank = rank if given else ps.get_context_parallel_rank()
        self.group = ps.get_context_parallel_group() if self.size > 1 and not given else None
        self.multiple = multiple

    @property
    def unit(self) -> int:
        return cp_unit(self.size, self.multiple)

    def padded_len(self, lengths: list[int]) -> int:
        return sum(-(-n // self.unit) * self.unit for n in lengths)

    def split(self, mb) -> None:
        """Cut ``mb`` (its documents' padded total already a multiple of the unit) to this rank's tokens
        in place; ``mb.unsplit`` [T] and ``mb.local_of`` [T] (each unsplit token's local row, -1 when
        another rank holds it) map back."""
        cu = torch.tensor([0] + mb.lengths).cumsum(0)
        sh = cp_shard(cu, self.size, self.rank, self.multiple)
        pad = sh.index < 0
        src = sh.index.clamp(min=0)
        mb.input_ids = mb.input_ids[:, src].masked_fill(pad[None], mb.pad_id)
        mb.targets = mb.targets[src].masked_fill(pad, 0)
        mb.real_mask = mb.real_mask[src] & ~pad
        mb.position_ids = sh.offset[None]  # positions restart per document and continue into its padding
        mb.lengths = (sh.cu_seqlens[1:] - sh.cu_seqlens[:-1]).tolist()
        if mb.routes is not None:
            k = mb.routes.shape[-1]
            mb.routes = torch.where(pad[:, None, None], torch.arange(k), mb.routes[src])
            mb.routes_valid = mb.routes_valid[src] & ~pad
        mb.unsplit = cp_unsplit_index(cu, self.size, self.multiple)
        mb.local_of = torch.full((int(cu[-1]),), -1, dtype=torch.long)
        mb.local_of[sh.index[~pad]] = torch.nonzero(~pad).squeeze(1)
        mb.unsplit_of_padded = sh.unsplit_of_padded
        mb.num_tokens = int(src.numel())

    def gather(self, x: torch.Tensor, mb) -> torch.Tensor:
        return gather_from_cp(x, mb.unsplit, self.group)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(t, group=self.group)
        return t

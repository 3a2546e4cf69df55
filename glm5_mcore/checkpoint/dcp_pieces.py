"""Loading some of the chunks of a Megatron-Core ``torch_dist`` tensor, straight into their places.

Megatron-Core's loader turns a sharded key into a PyTorch ``ShardedTensor`` whose metadata lists every
fragment of the tensor, the ones another rank would load placed on "rank + 1 mod world size"
(strategies/torch.py, ``sharded_tensor_to_torch_sharded_tensor``). In one process (world size 1)
that is rank 0 itself, so loading only some of a key's fragments (a slice of a layer's experts,
which share one key with an expert axis) fails its local-shard count check. ``load_pieces`` asks
PyTorch DCP for exactly the chunks wanted, by global offset and size, through a minimal load
planner: each read lands in a view of its destination (``DirectReader`` copies raw bytes there). With
``no_dist`` it needs no collective, so one rank may read what others do not: ``mcore-to-hf``'s slices of a layer's
experts, and the whole stored tensors a dense checkpoint's weights are quantized from into an FP8 base
(``fp8_sharded.FP8Load``), whatever the rank's shard.
"""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list


class _PiecePlanner(LoadPlanner):
    """Reads ``pieces[key] = [(global_offset, destination)]`` (destination shaped like the chunk)."""

    def __init__(self, pieces: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]], where: str):
        self.pieces, self.where, self.md = pieces, where, None

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:
        self.md = metadata

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, pieces in self.pieces.items():
            md = self.md.state_dict_metadata.get(key)
            if not isinstance(md, TensorStorageMetadata):
                raise ValueError(f"{self.where}: no tensor {key!r} in the checkpoint")
            for off, t in pieces:
                if len(off) != len(md.size) or any(o + s > n for o, s, n in zip(off, t.shape, md.size)):
                    raise ValueError(f"{self.where}: {key}: chunk at {list(off)} of shape {list(t.shape)} lies "
                                     f"outside the stored shape {list(md.size)}")
            chunks = [ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.shape) for off, t in pieces]
            items += create_read_items_for_chunk_list(key, md, chunks)
        return LoadPlan(items)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item, value) -> None:
        raise ValueError(f"{self.where}: {read_item.dest_index.fqn}: stored as bytes, expected a tensor")

    def resolve_tensor(self, read_item) -> torch.Tensor:
        _, t = self.pieces[read_item.dest_index.fqn][read_item.dest_index.index]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(dim, start, length)
        return t

    def commit_tensor(self, read_item, tensor) -> None:
        return None


def load_pieces(sharded: dict, reader, where: str) -> None:
    """Fill the data of every Megatron ``ShardedTensor`` in ``sharded`` (values: one, or a list from a
    factory) from ``reader``'s checkpoint, reading only their own chunks."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from torch.distributed.checkpoint import state_dict_loader

    pieces: dict[str, list] = {}
    for v in sharded.values():
        for sh in (v if isinstance(v, (list, tuple)) else [v]):
            if not isinstance(sh, ShardedTensor) or sh.flattened_range is not None:
                raise ValueError(f"{where}: {getattr(sh, 'key', sh)}: only whole ShardedTensors load in pieces")
            dest = sh.data.view((1,) * sh.prepend_axis_num + tuple(sh.local_shape))
            pieces.setdefault(sh.key, []).append((tuple(sh.global_offset), dest))
    state_dict_loader._load_state_dict({}, reader, planner=_PiecePlanner(pieces, where), no_dist=True)

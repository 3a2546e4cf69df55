"""A frozen FP8 base (``model.base_dtype=fp8``) in a Megatron-Core distributed checkpoint, stored as the HF
release stores it: no dequantize on save, no requantize on load.

Each FP8-base weight ``W [M, N]`` (``model.fp8_linear``: a ``BlockFP8Weight``, or TE's blockwise FP8 primary
weight) is saved as two plain ShardedTensors on the same sharding grid:

    {key}             float8_e4m3fn [M, N]                               the stored bytes
    {key}_scale_inv   float32 [ceil(M/b), ceil(N/b)]                     one scale per b×b block

(the HF names' ``weight_scale_inv`` beside ``weight``), and the common state holds ``fp8_base_block: b``.
Megatron-Core saves TE's FP8 primary weights as the TE tensor object (its data and scales pickled inside,
readable only through TE) and dequantizes them on load; these two tensors need no TE, and reshard like any
weight: a shard (TP, or a GLU factory's gate / up half) is whole blocks, so its scales are a slice of the
scale grid at ``offset / b`` (a layout whose shard would cut a block is a ValueError naming the tensor).

Loading (``FP8Load``) takes each weight as the model holds it: stored FP8 into an FP8-base weight as the
bytes are (``fp8_linear.load_block_fp8_``); stored FP8 into a dense weight (bf16 LoRA, full fine-tuning,
parity) dequantized per block; a dense checkpoint into an FP8-base weight quantized once with the release's
block scheme (said on stderr). A checkpoint without FP8 tensors is read exactly as before.

A dense weight quantized into the FP8 base is quantized as the HF path (``hf_load``) quantizes a dense
folder, so the frozen base does not depend on the layout: every rank reads the whole stored tensor
(``dcp_pieces.load_pieces``, no collective; one layer at a time), splits a GLU ``linear_fc1`` into its HF gate and
up, quantizes each whole HF tensor in ``b``×``b`` blocks, then fuses and takes its shard
(``hf_load.load_fp8_parts``). One rank, TP 2 and ETP 2 hold the same bytes; a layout whose shard (or a gate
half) would cut a block is refused in the HF path's words. Quantizing the rank's shard instead would cut
blocks at shard edges and straddle gate and up: another base at each layout. ``b`` is the model's FP8 block
(``model_source.base_fp8_block``: ``hf/config.json``'s ``quantization_config``, which ``hf-to-mcore
--dequantize-fp8`` keeps, so a dequantized release comes back in its own blocks).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

import re

import torch
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from torch.distributed.checkpoint import FileSystemReader

from glm5_mcore.checkpoint.checks import check_finite, check_finite_fp8
from glm5_mcore.checkpoint.dcp_pieces import load_pieces
from glm5_mcore.checkpoint.fp8 import quantize_fp8_blocks, scale_shape
from glm5_mcore.checkpoint.folder_config import notice
from glm5_mcore.checkpoint.hf_io import FP8_BLOCK, dequantize_fp8_blocks
from glm5_mcore.checkpoint.hf_load import load_fp8_parts, mcore_to_hf_sources
from glm5_mcore.checkpoint.megatron_lm import dcp_metadata
from glm5_mcore.model.fp8_linear import BlockFP8Weight, is_te_quantized, load_block_fp8_

SCALE_SUFFIX = "_scale_inv"
"""The key of a stored weight's block scales: ``{key}_scale_inv`` (the HF ``weight_scale_inv``)."""
BLOCK_KEY = "fp8_base_block"
"""Common-state entry: the block size ``b`` of the stored scales."""


def stored_fp8(p) -> Optional[tuple[torch.Tensor, torch.Tensor, int]]:
    """(e4m3 data ``[M, N]``, fp32 scales, block) a frozen FP8-base weight holds, or None for any other tensor.
    A ``BlockFP8Weight``'s own tensors (no copy); a TE blockwise weight's row-wise data and its scales without
    TE's column padding."""
    if isinstance(p, BlockFP8Weight):
        return p.data_fp8, p.scale_inv, p.block
    if p is not None and is_te_quantized(p) and getattr(p, "_rowwise_data", None) is not None:
        q = p._rowwise_data.view(torch.float8_e4m3fn)
        bm, bn = scale_shape(tuple(q.shape), FP8_BLOCK)
        return q, p._rowwise_scale_inv[:bm, :bn].contiguous(), FP8_BLOCK
    return None


# --------------------------------------------------------------------------------------------------
# The two sharded entries of one weight
# --------------------------------------------------------------------------------------------------
def _scale_of(sh: ShardedTensor, s: torch.Tensor, block: int) -> ShardedTensor:
    """The ShardedTensor of the scales ``s`` of the weight shard ``sh``: its block grid (prepended axes as they are)."""
    p = sh.prepend_axis_num
    return dataclasses.replace(
        sh, key=sh.key + SCALE_SUFFIX, data=s, dtype=s.dtype, local_shape=tuple(s.shape),
        global_shape=tuple(sh.global_shape[:p]) + tuple(-(-g // block) for g in sh.global_shape[p:]),
        global_offset=tuple(sh.global_offset[:p]) + tuple(o // block for o in sh.global_offset[p:]))


def _check_blocks(sq: ShardedTensor, ss: ShardedTensor, block: int, what: str) -> None:
    """The scale shard ``ss`` is exactly the block grid of the weight shard ``sq``: every shard starts on a block
    edge and only the global tensor's last block along a dimension may be partial."""
    p = sq.prepend_axis_num
    for d in range(len(sq.local_shape)):
        off, n, g = sq.global_offset[p + d], sq.local_shape[d], sq.global_shape[p + d]
        if off % block or (n % block and off + n != g) or ss.global_offset[p + d] * block != off or \
                ss.local_shape[d] != -(-n // block) or ss.global_shape[p + d] != -(-g // block):
            raise ValueError(f"{what}: a shard of {list(sq.local_shape)} at offset {list(sq.global_offset[p:])} of "
                             f"{list(sq.global_shape[p:])} cuts its {block}x{block} FP8 blocks; use a layout whose "
                             f"shards are multiples of {block}")


def fp8_pair(entry, q: torch.Tensor, s: torch.Tensor, block: int, what: str) -> tuple:
    """(entry of the e4m3 data ``q``, entry of the scales ``s``) standing for ``entry`` (a ShardedTensor or
    a ShardedTensorFactory, e.g. Megatron's GLU split of ``linear_fc1``, over the logical weight): the same
    key, grid and factory, the data replaced; the scales at ``{key}_scale_inv`` on the block grid."""
    if isinstance(entry, ShardedTensorFactory):
        eq = dataclasses.replace(entry, data=q)
        es = dataclasses.replace(entry, key=entry.key + SCALE_SUFFIX, data=s)
        built = zip([t for t in nested_values(eq.build()) if isinstance(t, ShardedTensor)],
                    [t for t in nested_values(es.build()) if isinstance(t, ShardedTensor)])
    else:
        eq = dataclasses.replace(entry, data=q, dtype=q.dtype)
        es = _scale_of(eq, s, block)
        built = [(eq, es)]
    for sq, ss in built:
        _check_blocks(sq, ss, block, what)
    return eq, es


def fp8_sharded_state_dict(sharded: dict) -> dict:
    """A model's sharded state dict to save: each FP8-base weight as its stored (data, scales) pair
    (``fp8_pair``), ``BLOCK_KEY`` in the common state; anything else as it was (a model without an FP8 base:
    ``sharded`` itself)."""
    out, blocks = {}, set()
    for name, entry in sharded.items():
        held = stored_fp8(getattr(entry, "data", None)) if isinstance(entry, (ShardedTensor, ShardedTensorFactory)) \
            else None
        if held is None:
            out[name] = entry
            continue
        q, s, block = held
        out[name], out[name + SCALE_SUFFIX] = fp8_pair(entry, q, s, block, name)
        blocks.add(block)
    if not blocks:
        return sharded
    if len(blocks) > 1:
        raise ValueError(f"the FP8 base mixes block sizes {sorted(blocks)}; a checkpoint stores one")
    out[BLOCK_KEY] = blocks.pop()
    return out


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------
def stored_block(path: str | Path) -> Optional[int]:
    """The FP8 block size of the base a distributed checkpoint stores in FP8 (its ``BLOCK_KEY``), or None when it
    stores no FP8 weight."""
    md = dcp_metadata(path)
    if not any(k.endswith(SCALE_SUFFIX) for k in md):
        return None
    block = dist_checkpointing.load_common_state_dict(str(path)).get(BLOCK_KEY)
    if not isinstance(block, int) or block < 1:
        raise ValueError(f"{path}: stores FP8 weights ({SCALE_SUFFIX} scales) but no valid {BLOCK_KEY} "
                         f"({block!r}) in its common state")
    return block


@dataclasses.dataclass
class _Pending:
    name: str
    param: torch.Tensor
    kind: str  # "stored" (FP8 into FP8), "dequantize" (FP8 into dense), "quantize" (dense into FP8)
    block: int
    entry: object = None  # "quantize": the model's sharded entry (its key and grid name the whole stored tensor)


_LAYER = re.compile(r"^((?:decoder|mtp)\.layers\.\d+)\.")


def whole_tensor_pieces(entry, md: dict) -> list[ShardedTensor]:
    """ShardedTensors covering the whole stored tensor(s) of a model's sharded ``entry`` (a ShardedTensor, or a
    factory such as Megatron's GLU split of ``linear_fc1``), in the stored dtype: the prepended axes (a routed
    expert's global index) as the entry has them, the weight's own axes whole. A GLU weight stored under one key
    is its ``[gate; up]``, under two (``singleton_local_shards``) gate then up."""
    if isinstance(entry, ShardedTensorFactory):  # built on a meta copy: no dequantized weight made
        meta = torch.empty(entry.data.shape, dtype=entry.data.dtype, device="meta")
        shards = [t for t in nested_values(dataclasses.replace(entry, data=meta).build())
                  if isinstance(t, ShardedTensor)]
    else:
        shards = [entry]
    out, seen = [], set()
    for sh in shards:
        if sh.key in seen:
            continue
        seen.add(sh.key)
        p = sh.prepend_axis_num
        dtype = getattr(getattr(md.get(sh.key), "properties", None), "dtype", None) or sh.dtype
        out.append(ShardedTensor.from_rank_offsets(
            sh.key, torch.empty(tuple(sh.global_shape[p:]), dtype=dtype),
            *[(i, sh.global_offset[i], sh.global_shape[i]) for i in range(p)], prepend_axis_num=p))
    return out


class FP8Load:
    """A model's sharded state dict to load from the checkpoint at ``path``, FP8 weights as each side holds them
    (module docstring); ``finish`` writes them into the model after Megatron-Core's load. ``model``: the model
    ``sharded`` is of (the HF layout of a dense weight quantized into its FP8 base)."""

    def __init__(self, sharded: dict, path: str | Path, model=None):
        self.path, self.model = Path(path), model
        md = dcp_metadata(path)
        stored = {k[: -len(SCALE_SUFFIX)] for k in md if k.endswith(SCALE_SUFFIX)}
        for k in stored:
            dtype = getattr(getattr(md.get(k), "properties", None), "dtype", None)
            if dtype != torch.float8_e4m3fn:
                raise ValueError(f"{path}: {k} has block scales ({k}{SCALE_SUFFIX}) but is stored as {dtype}, "
                                 "not float8_e4m3fn")
        ckpt_block = stored_block(path) if stored else None
        self.sharded, self.pending = {}, []
        for name, entry in sharded.items():
            param = getattr(entry, "data", None)
            held = stored_fp8(param) if isinstance(entry, (ShardedTensor, ShardedTensorFactory)) else None
            in_ckpt = isinstance(entry, (ShardedTensor, ShardedTensorFactory)) and entry.key in stored
            if held is None and not in_ckpt:
                self.sharded[name] = entry
                continue
            if held is not None and not in_ckpt:  # a dense checkpoint into the FP8 base: read whole in finish
                if model is None:
                    raise ValueError(f"{path}: {name} is stored dense; quantizing it into the FP8 base needs the model")
                self.pending.append(_Pending(name, param, "quantize", held[2], entry))
                continue
            if held is not None and held[2] != ckpt_block:
                raise ValueError(f"{path}: {name} is stored in {ckpt_block}x{ckpt_block} FP8 blocks, the model's FP8 "
                                 f"base was built for {held[2]}x{held[2]}")
            if isinstance(param, BlockFP8Weight):  # read straight into the weight's own bytes
                q, s = param.data_fp8, param.scale_inv
            else:
                q = torch.empty(param.shape, dtype=torch.float8_e4m3fn, device=param.device)
                s = torch.empty(scale_shape(tuple(param.shape), ckpt_block), dtype=torch.float32, device=param.device)
            self.sharded[name], self.sharded[name + SCALE_SUFFIX] = fp8_pair(entry, q, s, ckpt_block,
                                                                              f"{path}: {name}")
            self.pending.append(_Pending(name, param, "stored" if held is not None else "dequantize", ckpt_block))

    @torch.no_grad()
    def finish(self, state: dict, allow_nonfinite: bool = False) -> tuple[dict, set[str]]:
        """Write the FP8 weights of the loaded ``state`` into the model. Returns (the rest of ``state``, for
        ``load_state_dict``, with FP8 checkpoint weights dequantized for dense parameters; the names written
        here)."""
        state, done = dict(state), set()
        for p in self.pending:
            if p.kind == "quantize":
                continue
            t = state.pop(p.name)
            s = state.pop(p.name + SCALE_SUFFIX)
            if not allow_nonfinite:
                check_finite_fp8(t, s, p.name, self.path)
            if p.kind == "stored":
                load_block_fp8_(p.param, t, s, p.block, f"{self.path}: {p.name}")
                done.add(p.name)
            else:
                state[p.name] = dequantize_fp8_blocks(t, s, p.block).to(p.param.dtype)
        return state, done | self._quantize_whole(allow_nonfinite)

    def _quantize_whole(self, allow_nonfinite: bool) -> set[str]:
        """The dense weights of an FP8 base (module docstring): each stored tensor read whole, one layer at a time,
        quantized per HF tensor and laid out by ``hf_load.load_fp8_parts``. Returns the names written."""
        todo = [p for p in self.pending if p.kind == "quantize"]
        if not todo:
            return set()
        layout = {name: (src, rank, size) for name, _, src, rank, size in
                  mcore_to_hf_sources(self.model, self.model.config.num_layers)}
        md, reader = dcp_metadata(self.path), FileSystemReader(str(self.path))
        layers: dict[str, list[_Pending]] = {}
        for p in todo:
            m = _LAYER.match(p.name)
            layers.setdefault(m.group(1) if m else "", []).append(p)
        for group in layers.values():
            pieces = {p.name: whole_tensor_pieces(p.entry, md) for p in group}
            load_pieces(pieces, reader, str(self.path))
            for p in group:
                src, rank, size = layout[p.name]
                full = torch.cat([sh.data for sh in pieces[p.name]], 0)
                parts = []
                for h, t in zip(src.names, full.chunk(2, 0) if src.is_glu else (full,)):
                    if not allow_nonfinite:
                        check_finite(t, p.name, self.path)
                    parts.append(quantize_fp8_blocks(t, p.block))
                load_fp8_parts(p.param, parts, p.block, p.name, src, rank, size, self.path)
        b = todo[0].block
        notice(f"{self.path}: {len(todo)} base tensors stored dense quantized once to FP8 (e4m3, {b}x{b} blocks, the "
               "release's scheme: each HF tensor whole, before sharding) for model.base_dtype=fp8")
        return {p.name for p in todo}

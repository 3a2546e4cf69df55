"""HF weights into a built Megatron-Core GLM-5 at this rank's layout: every parameter and buffer
named through the one table (``checkpoint.hf_names``), sliced to this rank's shard by Megatron's own
partition attributes (the embedding and output layer first padded with zero rows to the model's padded
vocabulary, ``model.vocab``), verified against the folder's manifest, NaN/Inf refused by name."""

from __future__ import annotations

import torch

from glm5_mcore.checkpoint.checks import check_finite, check_finite_fp8
from glm5_mcore.checkpoint.folder_config import notice
from glm5_mcore.checkpoint.hf_io import HFCheckpoint
from glm5_mcore.checkpoint.hf_names import hf_source, shard_for_rank
from glm5_mcore.checkpoint.manifest import StreamVerifier
from glm5_mcore.config import GLM5Config
from glm5_mcore.model.fp8_linear import (BlockFP8Weight, block_shard, fuse_blocks, is_te_quantized,
                                         load_block_fp8_, stored_or_quantized)
from glm5_mcore.model.parallel import rank_offsets
from glm5_mcore.model.vocab import VOCAB_PARALLEL, pad_vocab_rows


def mcore_to_hf_sources(model, num_hidden_layers: int):
    """Yield ``(megatron_name, tensor, HFSource, tp_rank, tp_size)`` for every param and buffer."""
    tp_rank, tp_size, etp_rank, etp_size, layer_offset, expert_offset = rank_offsets(model)
    for name, t in model.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state") or "local_tokens_per_expert" in name or ".lora." in name:
            continue  # LoRA adapters are not HF base weights
        is_expert = ".experts." in name
        src = hf_source(name, num_hidden_layers, layer_offset, expert_offset if is_expert else 0)
        yield name, t, src, (etp_rank if is_expert else tp_rank), (etp_size if is_expert else tp_size)


@torch.no_grad()
def load_hf_weights(model, hf_dir, glm5: GLM5Config, skip_prefixes: tuple = ()) -> int:
    """Copy every parameter and buffer of this rank from the HF folder. Returns #tensors loaded.
    Megatron names starting with one of ``skip_prefixes`` keep their initialisation (a fresh MTP
    block: ``skip_prefixes=("mtp.",)``).

    A model with a frozen FP8 base (``model.fp8_linear.apply_fp8_base``, or TE FP8 weights) gets those
    weights as the folder stores them, e4m3 + block scales undequantized; a folder that stores them in
    bf16/fp32 is quantized once with the release's block scheme (said on stderr).

    Errors name the missing tensor, or the tensor whose shape does not match the model's. A folder with
    a checksum manifest (one we wrote) is verified from the bytes read (``manifest.StreamVerifier``),
    before this returns; a corrupt file is named before any error it caused.
    """
    checks = StreamVerifier(hf_dir)
    ckpt = HFCheckpoint(hf_dir, checks)
    try:
        n = _copy_weights(model, hf_dir, glm5, ckpt, skip_prefixes)
    except BaseException:
        checks.result()
        raise
    checks.result()
    return n


def _copy_weights(model, hf_dir, glm5: GLM5Config, ckpt: HFCheckpoint, skip_prefixes: tuple) -> int:
    n, quantized = 0, []
    for name, target, src, rank, size in mcore_to_hf_sources(model, glm5.num_hidden_layers):
        if skip_prefixes and name.startswith(skip_prefixes):
            continue
        if isinstance(target, BlockFP8Weight) or is_te_quantized(target):
            quantized += _copy_fp8(name, target, src, rank, size, ckpt)
            n += 1
            continue
        parts = [ckpt.get(h) for h in src.names]
        if src.is_glu and parts[0].shape != parts[1].shape:
            raise ValueError(f"{hf_dir}: {src.names[0]} {tuple(parts[0].shape)} and {src.names[1]} "
                             f"{tuple(parts[1].shape)} differ")
        full = torch.cat(parts, dim=0) if src.is_glu else parts[0]
        if name in VOCAB_PARALLEL and full.shape[0] == glm5.vocab_size:  # zero rows up to the padded vocabulary
            full = pad_vocab_rows(full, target.shape[0] * (size if getattr(target, "tensor_model_parallel", False) else 1))
        shard = shard_for_rank(full, target, rank, size, src.is_glu)
        if tuple(shard.shape) != tuple(target.shape):
            raise ValueError(f"{hf_dir}: tensor {'+'.join(src.names)} has shape {tuple(full.shape)}, "
                             f"model expects {tuple(target.shape)} for {name} on this rank")
        check_finite(shard, "+".join(src.names), hf_dir)
        target.data.copy_(shard.to(target.dtype))
        n += 1
    if quantized:
        notice(f"{hf_dir}: {len(quantized)} base tensors stored in {'/'.join(sorted(set(quantized)))} quantized once "
               f"to FP8 (e4m3, {ckpt.block}x{ckpt.block} blocks, the release's scheme) for model.base_dtype=fp8")
    return n


def _copy_fp8(name, target, src, rank: int, size: int, ckpt: HFCheckpoint) -> list[str]:
    """One FP8-base weight: its HF tensors as stored (or quantized once), fused, this rank's shard.
    Returns the stored dtype of each HF tensor that had to be quantized."""
    parts, quantized = [], []
    for h in src.names:
        t, scale = ckpt.get_stored(h)
        if scale is None:
            quantized.append(str(t.dtype).replace("torch.", ""))
        if scale is None:
            check_finite(t, h, ckpt.dir)
        else:
            check_finite_fp8(t, scale, h, ckpt.dir)
        parts.append(stored_or_quantized(t, scale, ckpt.block, h))
    load_fp8_parts(target, parts, ckpt.block, name, src, rank, size, ckpt.dir)
    return quantized


def load_fp8_parts(target, parts: list[tuple[torch.Tensor, torch.Tensor]], block: int, name: str, src, rank: int,
                   size: int, where) -> None:
    """The one way a frozen FP8-base weight is laid out from its whole HF tensors: ``parts`` = (e4m3 ``[M, N]``,
    scales) of each HF tensor ``src.names`` (gate and up apart for a GLU weight), fused as Megatron holds it
    (``fuse_blocks``: the gate's rows whole blocks), this rank's shard taken (``block_shard``: a shard that cuts a
    block is refused naming the tensor) and written into ``target`` (the Megatron parameter ``name``). The HF
    path and a dense distributed checkpoint (``fp8_sharded.FP8Load``) both go through it, so a layout gets the
    same bytes, or the same refusal, from either."""
    label = "+".join(src.names)
    if src.is_glu and parts[0][0].shape != parts[1][0].shape:
        raise ValueError(f"{where}: {src.names[0]} {tuple(parts[0][0].shape)} and {src.names[1]} "
                         f"{tuple(parts[1][0].shape)} differ")
    q, s = fuse_blocks(parts, block, label)
    q, s = block_shard(q, s, block, target, rank, size, src.is_glu, f"{label} ({name})")
    load_block_fp8_(target, q, s, block, f"{where}: {label} ({name})")

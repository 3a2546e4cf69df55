"""HF weights into a built Megatron-Core GLM-5 at this rank's layout: every parameter and buffer
named through the one table (``checkpoint.hf_names``), sliced to this rank's shard by Megatron's own
partition attributes (the embedding and output layer first padded with zero rows to the model's padded
vocabulary, ``model.vocab``), verified against the folder's manifest, NaN/Inf refused by name."""

from __future__ import annotations

import torch

from glm5_mcore.checkpoint.checks import check_finite
from glm5_mcore.checkpoint.hf_io import HFCheckpoint
from glm5_mcore.checkpoint.hf_names import hf_source, shard_for_rank
from glm5_mcore.checkpoint.manifest import StreamVerifier
from glm5_mcore.config import GLM5Config
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
    n = 0
    for name, target, src, rank, size in mcore_to_hf_sources(model, glm5.num_hidden_layers):
        if skip_prefixes and name.startswith(skip_prefixes):
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
    return n

"""What a folder really stores: how many MTP layers (and the config to build for them), and each
Megatron-LM / Bridge folders included.

transformers' ``GlmMoeDsaForCausalLM`` has no MTP module: ``save_pretrained`` writes no
``model.layers.{num_hidden_layers}.*`` tensors while ``config.json`` keeps ``num_nextn_predict_layers``.
Every entry point (parity, convert, lora export, sft, rl) reads its config through ``hf_dir_config`` /
``checkpoint_config``: MTP layers whose tensors are absent are dropped from the model (one notice
line on stderr), so such a folder loads, trains without the MTP loss, and round-trips to exactly the
tensors it holds. ``config.json`` itself is never edited. (Each tensor's stored dtype:
``glm5_mcore.checkpoint.dtypes``.)
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Iterable, Optional

from glm5_mcore.checkpoint import megatron_lm
from glm5_mcore.checkpoint.hf_io import HFCheckpoint
from glm5_mcore.checkpoint.layout import model_dir
from glm5_mcore.config import GLM5Config


def notice(message: str) -> None:
    print(f"glm5: notice: {message}", file=sys.stderr, flush=True)


def count_stored(glm5: GLM5Config, names: Iterable[str], prefix: str) -> int:
    """The leading MTP layers (of the ``num_nextn_predict_layers`` declared) with any tensor among
    ``names``; ``prefix(m)`` is the name prefix of MTP layer ``m``."""
    names = list(names)
    n = 0
    for m in range(glm5.num_nextn_predict_layers):
        if not any(k.startswith(prefix(m)) for k in names):
            break
        n = m + 1
    return n


def with_mtp_layers(glm5: GLM5Config, stored: int, source: str | Path, quiet: bool = False) -> GLM5Config:
    """``glm5`` with ``num_nextn_predict_layers = stored`` (a notice when that drops layers)."""
    if stored == glm5.num_nextn_predict_layers:
        return glm5
    if not quiet:
        notice(f"{source}: config.json declares num_nextn_predict_layers={glm5.num_nextn_predict_layers} but the "
               f"weights hold {stored} MTP layer(s) (a transformers save_pretrained folder?): building the model "
               f"without {'the MTP block' if stored == 0 else 'the missing MTP layers'}, MTP loss off")
    return dataclasses.replace(glm5, num_nextn_predict_layers=stored)


def hf_dir_config(hf_dir: str | Path, quiet: bool = False) -> GLM5Config:
    """The config of an HF folder, its MTP count cut to the MTP layers its weights store."""
    glm5 = GLM5Config.from_hf_dir(hf_dir)
    if glm5.num_nextn_predict_layers == 0:
        return glm5
    L = glm5.num_hidden_layers
    stored = count_stored(glm5, HFCheckpoint(hf_dir).keys(), lambda m: f"model.layers.{L + m}.")
    return with_mtp_layers(glm5, stored, hf_dir, quiet)


def checkpoint_model_keys(model_path: str | Path) -> list[str]:
    """The tensor keys of a Megatron-Core distributed checkpoint (metadata only)."""
    return list(megatron_lm.dcp_metadata(model_path))


def checkpoint_config(root: str | Path, iteration: Optional[int] = None, quiet: bool = False) -> GLM5Config:
    """The config of a glm5-mcore checkpoint folder (``DIR/hf/config.json``), its MTP count cut to
    the MTP layers the base weights (``DIR/iter_N/model``) store; of a Megatron-LM / Bridge folder,
    ``megatron_lm.glm5_config``."""
    if megatron_lm.is_foreign(root):  # Megatron-LM / Bridge: their own config, MTP as stored
        return megatron_lm.glm5_config(root, None, iteration)
    glm5 = GLM5Config.from_hf_dir(Path(root) / "hf")
    if glm5.num_nextn_predict_layers == 0:
        return glm5
    path = model_dir(root, iteration)
    stored = count_stored(glm5, checkpoint_model_keys(path), lambda m: f"mtp.layers.{m}.")
    return with_mtp_layers(glm5, stored, path, quiet)

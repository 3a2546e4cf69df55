"""What a folder really stores: how many MTP layers (and the config to build for them), and each
tensor's dtype.

transformers' ``GlmMoeDsaForCausalLM`` has no MTP module: ``save_pretrained`` writes no
``model.layers.{num_hidden_layers}.*`` tensors while ``config.json`` keeps ``num_nextn_predict_layers``.
Every entry point (parity, convert, lora export, sft, rl) reads its config through ``hf_dir_config`` /
``checkpoint_config``: MTP layers whose tensors are absent are dropped from the model (one notice
line on stderr), so such a folder loads, trains without the MTP loss, and round-trips to exactly the
tensors it holds. ``config.json`` itself is never edited.

A checkpoint's ``hf/dtypes.json`` records the dtype each HF tensor of its origin was stored in
(``{"default": "BF16", "tensors": {name: dtype, ...}}`` listing only the exceptions), so that
``mcore-to-hf`` writes every tensor back as it came, whatever ``config.json``'s ``dtype`` says.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import sys
from pathlib import Path
from typing import Iterable, Optional

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
    from glm5_mcore.checkpoint.hf_io import HFCheckpoint

    L = glm5.num_hidden_layers
    stored = count_stored(glm5, HFCheckpoint(hf_dir).keys(), lambda m: f"model.layers.{L + m}.")
    return with_mtp_layers(glm5, stored, hf_dir, quiet)


def checkpoint_model_keys(model_path: str | Path) -> list[str]:
    """The tensor keys of a Megatron-Core distributed checkpoint (metadata only)."""
    from torch.distributed.checkpoint import FileSystemReader

    try:
        return list(FileSystemReader(str(model_path)).read_metadata().state_dict_metadata)
    except Exception as e:  # noqa: BLE001 - any unreadable metadata is a bad input
        raise ValueError(f"{model_path}: unreadable distributed-checkpoint metadata ({e})") from None


def checkpoint_config(root: str | Path, iteration: Optional[int] = None, quiet: bool = False) -> GLM5Config:
    """The config of a glm5-mcore checkpoint folder (``DIR/hf/config.json``), its MTP count cut to
    the MTP layers the base weights (``DIR/iter_N/model``) store; of a Megatron-LM / Bridge folder,
    ``foreign_ckpt.glm5_config``."""
    from glm5_mcore.checkpoint import megatron_lm as foreign_ckpt
    from glm5_mcore.checkpoint.layout import model_dir

    if foreign_ckpt.is_foreign(root):  # Megatron-LM / Bridge: their own config, MTP as stored
        return foreign_ckpt.glm5_config(root, None, iteration)
    glm5 = GLM5Config.from_hf_dir(Path(root) / "hf")
    if glm5.num_nextn_predict_layers == 0:
        return glm5
    path = model_dir(root, iteration)
    stored = count_stored(glm5, checkpoint_model_keys(path), lambda m: f"mtp.layers.{m}.")
    return with_mtp_layers(glm5, stored, path, quiet)


def run_model_config(ckpt: Optional[str], hf_dir: str, quiet: bool = False) -> GLM5Config:
    """The GLM5Config a run (SFT, RL, parity) builds from ``model.ckpt`` / ``model.hf_dir``: a Megatron-LM /
    Bridge checkpoint's own config checked field by field against ``hf_dir``'s config.json (a ValueError
    naming the file and field on a mismatch), a glm5-mcore checkpoint's ``hf/config.json``, else
    ``hf_dir``'s; MTP layers as stored."""
    from glm5_mcore.checkpoint import megatron_lm as foreign_ckpt

    if ckpt and foreign_ckpt.is_foreign(ckpt):
        return foreign_ckpt.glm5_config(ckpt, GLM5Config.from_hf_dir(hf_dir))
    return checkpoint_config(ckpt, quiet=quiet) if ckpt else hf_dir_config(hf_dir, quiet=quiet)


DTYPES_FILE = "dtypes.json"


def record_dtypes(hf_dir: str | Path) -> dict:
    """``{"default": most common stored dtype, "tensors": {HF name: dtype}}`` of an HF folder's
    weights (safetensors names, e.g. "BF16", "F8_E4M3"), from the headers only; names are the
    on-disk per-expert names (a fused ``experts.gate_up_proj`` stands for all its experts)."""
    from glm5_mcore.checkpoint.hf_io import DTYPE_NAMES, HFCheckpoint

    ckpt = HFCheckpoint(hf_dir)
    stored = {}
    for name in ckpt.keys():
        if name.endswith("_scale_inv"):
            continue
        stored[name] = DTYPE_NAMES[ckpt.info(name)[1]]
    if not stored:
        return {"default": None, "tensors": {}}
    default = collections.Counter(stored.values()).most_common(1)[0][0]
    return {"default": default, "tensors": {k: v for k, v in stored.items() if v != default}}


def stored_dtype(record: Optional[dict], hf_name: str) -> Optional[str]:
    """The recorded dtype name of ``hf_name`` (per-expert names also match a fused record), or None."""
    if not record:
        return None
    t = record.get("tensors", {})
    if hf_name in t:
        return t[hf_name]
    from glm5_mcore.checkpoint.hf_io import _FUSED

    m = _FUSED.match(hf_name)
    if m:
        fused = f"{m.group(1)}.{'down_proj' if m.group(3) == 'down_proj' else 'gate_up_proj'}"
        if fused in t:
            return t[fused]
    return record.get("default")


def read_dtypes(hf_meta: str | Path) -> Optional[dict]:
    """The dtype record of a checkpoint's ``hf/`` folder, or None (no HF origin)."""
    path = Path(hf_meta) / DTYPES_FILE
    if not path.is_file():
        return None
    try:
        d = json.loads(path.read_text())
        if not isinstance(d.get("tensors", {}), dict):
            raise ValueError("'tensors' is not an object")
        return d
    except (json.JSONDecodeError, ValueError, AttributeError) as e:
        raise ValueError(f"{path}: not a dtype record ({e})") from None

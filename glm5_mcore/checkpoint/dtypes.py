"""The dtype each HF tensor was stored in, recorded in a checkpoint's ``hf/dtypes.json``
(``{"default": "BF16", "tensors": {name: dtype, ...}}`` listing only the exceptions), so that
``mcore-to-hf`` writes every tensor back as it came, whatever ``config.json``'s ``dtype`` says."""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Optional

from glm5_mcore.checkpoint.hf_io import DTYPE_NAMES, FUSED_EXPERT, HFCheckpoint


DTYPES_FILE = "dtypes.json"


def record_dtypes(hf_dir: str | Path) -> dict:
    """``{"default": most common stored dtype, "tensors": {HF name: dtype}}`` of an HF folder's
    weights (safetensors names, e.g. "BF16", "F8_E4M3"), from the headers only; names are the
    on-disk per-expert names (a fused ``experts.gate_up_proj`` stands for all its experts)."""
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
    m = FUSED_EXPERT.match(hf_name)
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

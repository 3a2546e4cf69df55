"""The fingerprint of an HF folder's weights, recorded as a checkpoint's or run's origin (``hf/source.json``,
``weights_sha256``): what a run was trained on, recognised later wherever the folder lies (``glm5 lora export
--merged --base DIR`` compares it, ``convert.merge_base``).

``weights_fingerprint``: sha256 over every tensor of the folder's safetensors files, in name order (so however
they are sharded), of its name, dtype, shape and first ``SAMPLE`` bytes as stored. Reading ~one page a tensor
and no weight, it tells apart folders of other weights of the same shapes: another seed, a fine-tune, an adapter
merged in (a LoRA delta ``B·A`` changes every element of each weight it touches, its first row included), an FP8
release and its bf16 twin. Two folders of the same bytes agree (a copy, another download, a re-sharding).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

from glm5_mcore.checkpoint.hf_io import DTYPE_NAMES, SafetensorsFile

SAMPLE = 256
"""Bytes of each tensor's data read into the fingerprint."""
KEY = "weights_sha256"
"""The fingerprint's key in ``hf/source.json``."""


def weights_fingerprint(folder: str | Path) -> Optional[str]:
    """The fingerprint of ``folder``'s ``*.safetensors`` weights (module docstring), or None when it holds none."""
    entries = []
    for path in sorted(Path(folder).glob("*.safetensors")):
        f = SafetensorsFile(path)
        for name, head in f.heads(SAMPLE).items():
            dtype, shape, _, _ = f.tensors[name]
            entries.append((name, DTYPE_NAMES[dtype], list(shape), head))
    if not entries:
        return None
    h = hashlib.sha256()
    for name, dtype, shape, head in sorted(entries, key=lambda e: e[0]):
        h.update(json.dumps([name, dtype, shape]).encode())
        h.update(head)
    return h.hexdigest()


def recorded_fingerprint(hf_meta: str | Path) -> Optional[str]:
    """The origin fingerprint an ``hf/`` folder's ``source.json`` records (None: none recorded, or no such file)."""
    path = Path(hf_meta) / "source.json"
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get(KEY)
    except (json.JSONDecodeError, AttributeError):
        return None

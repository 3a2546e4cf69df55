"""Reading an HF GLM-5 checkpoint folder: config.json + safetensors (one file or sharded with an index).

Tensors are read lazily one at a time (``safe_open``), so nothing holds the whole model. Routed
experts are served in the on-disk per-expert layout whichever layout the files use: the in-memory
fused ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]`` are split on read.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

_FUSED = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class HFCheckpoint:
    """Name → tensor access over the safetensors files of one HF folder."""

    def __init__(self, hf_dir: str | Path):
        self.dir = Path(hf_dir)
        self._handles: dict[Path, object] = {}
        if not self.dir.is_dir():
            raise FileNotFoundError(f"{self.dir}: HF checkpoint folder does not exist")
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{index}: not a safetensors index ({e})") from None
            self.files = {n: self.dir / f for n, f in weight_map.items()}
        else:
            shards = sorted(self.dir.glob("*.safetensors"))
            if not shards:
                raise FileNotFoundError(f"{self.dir}: no *.safetensors files and no model.safetensors.index.json")
            self.files = {}
            for f in shards:
                for n in self._open(f).keys():
                    self.files[n] = f

    def _open(self, path: Path):
        if path not in self._handles:
            if not path.is_file():
                raise FileNotFoundError(f"{path}: shard listed in the index is missing")
            try:
                self._handles[path] = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise ValueError(f"{path}: unreadable safetensors file ({e})") from None
        return self._handles[path]

    def keys(self) -> list[str]:
        return list(self.files)

    def __contains__(self, name: str) -> bool:
        if name in self.files:
            return True
        m = _FUSED.match(name)
        return bool(m) and self._fused_name(m) in self.files

    @staticmethod
    def _fused_name(m) -> str:
        return f"{m.group(1)}.{'down_proj' if m.group(3) == 'down_proj' else 'gate_up_proj'}"

    def get(self, name: str) -> torch.Tensor:
        """The tensor called ``name`` (per-expert names also served from fused expert tensors)."""
        if name in self.files:
            path = self.files[name]
            try:
                return self._open(path).get_tensor(name)
            except (FileNotFoundError, ValueError):
                raise
            except Exception as e:
                raise ValueError(f"{path}: tensor {name} could not be read ({e})") from None
        m = _FUSED.match(name)
        if m and self._fused_name(m) in self.files:
            fused = self.get(self._fused_name(m))[int(m.group(2))]
            if m.group(3) == "down_proj":
                return fused
            gate, up = fused.chunk(2, dim=0)
            return gate if m.group(3) == "gate_proj" else up
        raise KeyError(f"{self.dir}: tensor {name} is missing from the checkpoint")

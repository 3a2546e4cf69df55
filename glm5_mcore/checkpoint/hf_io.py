"""Reading an HF GLM-5 checkpoint folder: config.json + safetensors (one file or sharded with an index).

``SafetensorsFile`` parses the header itself and reads each tensor with ``pread`` into its own
buffer: nothing is memory-mapped, so resident memory is only the tensors a caller holds (an mmap
keeps every touched page of a 5 GB shard resident), a routed expert can be read out of a fused
``[E, ...]`` tensor without reading the others, and a truncated or corrupt file is caught when it
is opened, naming the file and tensor.

``HFCheckpoint`` serves tensors by HF name in the on-disk per-expert layout whichever layout the
files use (the in-memory fused ``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]``
are split on read) and dequantizes FP8 weights with 128×128 block scales (``weight_scale_inv``).
"""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path
from typing import Optional

import torch

from glm5_mcore.checkpoint.direct_io import DirectWriter

FUSED_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_BLOCK = 128
_MAX_HEADER = 100 << 20


class SafetensorsFile:
    """One ``.safetensors`` file: header parsed and checked on open, tensors read on demand."""

    def __init__(self, path: str | Path, verifier=None):
        self.path = Path(path)
        self.verifier = verifier  # a manifest.StreamVerifier fed every tensor read (checksums from these bytes)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: safetensors file is missing")
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise ValueError(f"{self.path}: truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", raw)
            if n > min(_MAX_HEADER, size - 8):
                raise ValueError(f"{self.path}: corrupt or truncated safetensors header "
                                 f"(header length {n}, file {size} bytes)")
            try:
                header = json.loads(f.read(n))
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise ValueError(f"{self.path}: corrupt safetensors header ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self._base = 8 + n
        self.tensors: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        data_size = size - self._base
        for name, info in header.items():
            try:
                dtype = DTYPES[info["dtype"]]
                shape = tuple(int(s) for s in info["shape"])
                start, end = (int(o) for o in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"{self.path}: tensor {name} has a malformed header entry {info}") from None
            nbytes = dtype.itemsize * _numel(shape)
            if end - start != nbytes:
                raise ValueError(f"{self.path}: tensor {name} spans {end - start} bytes, "
                                 f"{info['dtype']}{list(shape)} needs {nbytes}")
            if end > data_size:
                raise ValueError(f"{self.path}: truncated: tensor {name} needs bytes up to {end} of the "
                                 f"data section, the file holds {data_size}")
            self.tensors[name] = (dtype, shape, start, end)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def nbytes(self, name: str) -> int:
        _, _, start, end = self.tensors[name]
        return end - start

    def heads(self, n: int) -> dict[str, bytes]:
        """{name: the first ``n`` bytes of its data as stored (all of it when smaller)} of every tensor, one
        ``pread`` each through one open file."""
        out = {}
        with open(self.path, "rb", buffering=0) as f:
            for name, (_, _, start, end) in self.tensors.items():
                out[name] = os.pread(f.fileno(), min(n, end - start), self._base + start)
        return out

    def read(self, name: str, index: Optional[int] = None) -> torch.Tensor:
        """Tensor ``name``, or only its slice ``[index]`` along dim 0 (one expert of a fused tensor)."""
        dtype, shape, start, end = self.tensors[name]
        if index is not None:
            row = (end - start) // shape[0]
            start, shape = start + index * row, shape[1:]
            end = start + row
        n = end - start
        if n == 0:
            return torch.empty(shape, dtype=dtype)
        buf = torch.empty(n, dtype=torch.uint8)  # not zero-filled: preadv overwrites it
        view, got = memoryview(buf.numpy()), 0
        with open(self.path, "rb", buffering=0) as f:
            while got < n:  # one preadv moves at most ~2 GiB
                k = os.preadv(f.fileno(), [view[got:]], self._base + start + got)
                if k <= 0:
                    break
                got += k
        if got != n:
            raise ValueError(f"{self.path}: tensor {name} could not be read (got {got} of {n} bytes)")
        if self.verifier is not None:
            self.verifier.feed(self.path, self._base + start, view)
        return buf.view(dtype).reshape(shape)


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def dequantize_fp8_blocks(w: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """FP8 weight [M, N] times its per-block scale [ceil(M/b), ceil(N/b)] → fp32 [M, N].

    Edge blocks may be partial (M or N not a multiple of ``block``, e.g. 576-row kv_a_proj)."""
    M, N = w.shape
    if scale_inv.shape != ((M + block - 1) // block, (N + block - 1) // block):
        raise ValueError(f"scale {tuple(scale_inv.shape)} does not tile a {M}x{N} weight in {block}x{block} blocks")
    s = scale_inv.float().repeat_interleave(block, 0)[:M].repeat_interleave(block, 1)[:, :N]
    return w.float() * s


def weight_block_size(hf_dir: str | Path) -> int:
    """The FP8 block size of an HF folder (``config.json``'s ``quantization_config.weight_block_size``, square
    ``[b, b]``); the release's 128 for a folder that declares none."""
    path = Path(hf_dir) / "config.json"
    try:
        qc = json.loads(path.read_text()).get("quantization_config") or {}
    except (OSError, json.JSONDecodeError, AttributeError):
        return FP8_BLOCK
    size = qc.get("weight_block_size") if isinstance(qc, dict) else None
    if size is None:
        return FP8_BLOCK
    if (not isinstance(size, list) or len(size) != 2 or size[0] != size[1] or not isinstance(size[0], int)
            or size[0] < 1):
        raise ValueError(f"{path}: quantization_config.weight_block_size={size!r}: expected square FP8 blocks [b, b]")
    return int(size[0])


class HFCheckpoint:
    """Name → tensor access over the safetensors files of one HF folder."""

    def __init__(self, hf_dir: str | Path, verifier=None):
        self.dir = Path(hf_dir)
        self.verifier = verifier
        if not self.dir.is_dir():
            raise FileNotFoundError(f"{self.dir}: HF checkpoint folder does not exist")
        self.block = weight_block_size(self.dir)
        """FP8 block size of the stored ``weight_scale_inv`` s."""
        self._open_files: dict[Path, SafetensorsFile] = {}
        index = self.dir / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise ValueError(f"{index}: not a safetensors index ({e})") from None
            self.files = {n: self.dir / f for n, f in weight_map.items()}
            for path in sorted(set(self.files.values())):
                missing = [n for n, p in self.files.items() if p == path and n not in self._file(path).tensors]
                if missing:
                    raise ValueError(f"{path}: tensor {missing[0]} listed in {index.name} is not in the file")
        else:
            shards = sorted(self.dir.glob("*.safetensors"))
            if not shards:
                raise FileNotFoundError(f"{self.dir}: no *.safetensors files and no model.safetensors.index.json")
            self.files = {n: f for f in shards for n in self._file(f).keys()}

    def _file(self, path: Path) -> SafetensorsFile:
        if path not in self._open_files:
            if not path.is_file():
                raise FileNotFoundError(f"{path}: shard listed in the index is missing")
            self._open_files[path] = SafetensorsFile(path, self.verifier)
        return self._open_files[path]

    def keys(self) -> list[str]:
        return list(self.files)

    def shard_paths(self) -> list[Path]:
        return sorted(set(self.files.values()))

    def __contains__(self, name: str) -> bool:
        return self.locate(name) is not None

    @staticmethod
    def _fused_name(m) -> str:
        return f"{m.group(1)}.{'down_proj' if m.group(3) == 'down_proj' else 'gate_up_proj'}"

    def locate(self, name: str) -> Optional[tuple[str, Optional[int], Optional[str]]]:
        """(stored name, expert index into a fused tensor or None, gate/up half or None)."""
        if name in self.files:
            return name, None, None
        m = FUSED_EXPERT.match(name)
        if m and self._fused_name(m) in self.files:
            half = None if m.group(3) == "down_proj" else m.group(3)
            return self._fused_name(m), int(m.group(2)), half
        return None

    def stored_names_for(self, name: str) -> list[str]:
        """The stored tensors ``get(name)`` reads (itself or its fused tensor, plus an FP8 scale)."""
        loc = self.locate(name)
        if loc is None:
            return []
        names = [loc[0]]
        if loc[0] + "_scale_inv" in self.files:
            names.append(loc[0] + "_scale_inv")
        return names

    def get(self, name: str) -> torch.Tensor:
        """The tensor called ``name``; per-expert names are also served from fused expert tensors and
        FP8 weights with a ``weight_scale_inv`` come back dequantized (fp32)."""
        t, scale = self.get_stored(name)
        if scale is not None:
            try:
                t = dequantize_fp8_blocks(t, scale, self.block)
            except ValueError as e:
                raise ValueError(f"{self.files[self.locate(name)[0]]}: tensor {name}: {e}") from None
        return t

    def get_stored(self, name: str) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(``name`` as stored, its ``weight_scale_inv`` block scales or None): FP8 weights undequantized
        (the FP8 base keeps them so, ``glm5_mcore.model.fp8_linear``)."""
        loc = self.locate(name)
        if loc is None:
            raise KeyError(f"{self.dir}: tensor {name} is missing from the checkpoint")
        stored, expert, half = loc
        f = self._file(self.files[stored])
        t = f.read(stored, expert)
        if half is not None:
            gate, up = t.chunk(2, dim=0)
            t = gate if half == "gate_proj" else up
        scale_name = stored + "_scale_inv"
        if t.dtype in FP8:
            if scale_name not in self.files or expert is not None:
                raise ValueError(f"{f.path}: FP8 tensor {stored} has no {scale_name} block scale")
            return t, self._file(self.files[scale_name]).read(scale_name)
        return t, None

    def info(self, name: str) -> tuple[Path, torch.dtype, tuple[int, ...], int]:
        """(file, stored dtype, shape of ``get(name)``, bytes read) from the headers, reading no data. An FP8
        tensor without its ``weight_scale_inv`` is the ValueError ``get_stored`` raises, here from the headers:
        before a converter writes anything."""
        loc = self.locate(name)
        if loc is None:
            raise KeyError(f"{self.dir}: tensor {name} is missing from the checkpoint")
        stored, expert, half = loc
        path = self.files[stored]
        f = self._file(path)
        dtype, shape, start, end = f.tensors[stored]
        if dtype in FP8 and (stored + "_scale_inv" not in self.files or expert is not None):
            raise ValueError(f"{path}: FP8 tensor {stored} has no {stored}_scale_inv block scale")
        nbytes = end - start
        if expert is not None:
            if expert >= shape[0]:
                raise ValueError(f"{path}: fused tensor {stored} holds {shape[0]} experts, "
                                 f"{name} asks for expert {expert}")
            shape, nbytes = shape[1:], nbytes // shape[0]
        if half is not None:
            shape = (shape[0] // 2, *shape[1:])
        return path, dtype, shape, nbytes


class PlannedSafetensorsWriter:
    """Safetensors shards whose layout is fixed up front: ``plan`` is [(name, dtype, shape)] in file
    order, split into files of at most ``max_bytes``. Tensors must then arrive in plan order: each
    file is streamed front to back (header, then tensor bytes) through ``DirectWriter``, past the
    page cache, and closed when its last tensor is in; ``finish`` checks every tensor arrived and
    writes ``model.safetensors.index.json``.
    """

    def __init__(self, out: Path, plan: list[tuple[str, torch.dtype, tuple[int, ...]]], max_bytes: int):
        self.out = Path(out)
        groups, size = [[]], 0
        for name, dtype, shape in plan:
            nb = dtype.itemsize * _numel(shape)
            if groups[-1] and size + nb > max_bytes:
                groups.append([])
                size = 0
            groups[-1].append((name, dtype, tuple(shape), nb))
            size += nb
        n = len(groups)
        self.order: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        self.files: list[tuple[Path, bytes, int]] = []  # (path, header bytes, index of its last tensor)
        self.weight_map, self.total = {}, 0
        for i, group in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors" if n > 1 else "model.safetensors"
            header, off = {"__metadata__": {"format": "pt"}}, 0
            for name, dtype, shape, nb in group:
                header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [off, off + nb]}
                self.order.append((name, dtype, shape))
                self.weight_map[name] = fname
                off += nb
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)
            self.files.append((self.out / fname, struct.pack("<Q", len(raw)) + raw, len(self.order) - 1))
            self.total += off
        self._next = 0  # index into order of the next tensor to arrive
        self._file = 0
        self._stream: Optional[DirectWriter] = None

    def write(self, name: str, t: torch.Tensor) -> None:
        if self._next >= len(self.order) or self.order[self._next][0] != name:
            expected = self.order[self._next][0] if self._next < len(self.order) else "nothing"
            raise ValueError(f"{name}: written out of plan order (expected {expected})")
        _, dtype, shape = self.order[self._next]
        if t.dtype != dtype or tuple(t.shape) != shape:
            raise ValueError(f"{name}: got {t.dtype}{list(t.shape)}, planned {dtype}{list(shape)}")
        if self._stream is None:
            path, header, _ = self.files[self._file]
            self._stream = DirectWriter(path)
            self._stream.write(header)
        self._stream.write(t.contiguous().view(-1).view(torch.uint8).numpy())
        if self._next == self.files[self._file][2]:
            self._stream.close()
            self._stream, self._file = None, self._file + 1
        self._next += 1

    def close(self) -> None:
        """Close an unfinished file (after an error); ``finish`` is the normal end."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def finish(self) -> None:
        self.close()
        if self._next < len(self.order):
            missing = [n for n, _, _ in self.order[self._next:]]
            raise RuntimeError(f"{len(missing)} planned tensors were never written, e.g. {missing[:3]}")
        index = {"metadata": {"total_size": self.total}, "weight_map": self.weight_map}
        (self.out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))

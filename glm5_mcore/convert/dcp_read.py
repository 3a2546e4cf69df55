"""Loading part of a Megatron-Core ``torch_dist`` checkpoint straight into the parameters' memory.

Megatron-Core's loader hands each stored chunk to ``torch.load`` (unpickle, allocate, read through a
buffered stream) and copies it into the destination. For a converter streaming a whole checkpoint
one layer at a time that is two copies and a pickle per tensor. ``load_sharded`` runs the same
translation (Megatron-Core's own helpers: sharded keys, PyTorch-DCP state dict, ``MCoreLoadPlanner``)
through ``DirectReader``, which reads a plan's records in large sequential runs and copies each
chunk's raw bytes (the ``torch.save`` zip member ``*/data/0``) into the destination when that is
the whole chunk, contiguous and of the stored dtype; anything else takes DCP's own path.
"""

from __future__ import annotations

import io
import mmap
import os
import struct
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.planner import LoadItemType
from torch.futures import Future

_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # zip local file header, 30 bytes


_PIECE = 64 << 20  # bytes read per pread run (one buffer, reused)
_ALIGN = 4096
_GAP = 1 << 20  # records closer than this are read in one run


class _Mem(io.RawIOBase):
    """Seekable read-only file over a memoryview (zipfile parses a record without copying it)."""

    def __init__(self, view: memoryview):
        self.view, self.pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: len(self.view) + offset}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, b) -> int:
        n = max(0, min(len(b), len(self.view) - self.pos))
        memoryview(b)[:n] = self.view[self.pos:self.pos + n]
        self.pos += n
        return n


def raw_data_offset(record: memoryview) -> Optional[int]:
    """Offset, inside one ``torch.save`` zip record, of its single storage's raw bytes (the member
    ``*/data/0``, stored uncompressed); None for anything else (several storages, compression)."""
    try:
        with zipfile.ZipFile(io.BufferedReader(_Mem(record))) as z:
            storages = [m for m in z.infolist() if m.filename.split("/")[-2:-1] == ["data"]]
            if len(storages) != 1 or not storages[0].filename.endswith("/data/0") or \
                    storages[0].compress_type != zipfile.ZIP_STORED:
                return None
            at = storages[0].header_offset
        fields = _LOCAL_HEADER.unpack(record[at:at + _LOCAL_HEADER.size])
        return at + _LOCAL_HEADER.size + fields[9] + fields[10] if fields[0] == 0x04034B50 else None
    except (zipfile.BadZipFile, struct.error, ValueError):
        return None


def _pread_into(fd: int, view: memoryview, offset: int, path: Path) -> int:
    """Fill ``view`` from ``offset``; returns the bytes read (fewer only at the end of the file)."""
    got = 0
    while got < len(view):
        k = os.preadv(fd, [view[got:]], offset + got)
        if k < 0:
            raise OSError(f"{path}: read failed at byte {offset + got}")
        if k == 0:
            break
        got += k
    return got


class _Runs:
    """Reads byte runs of one file into a reused page-aligned buffer, with ``O_DIRECT`` where the
    file system allows it (the device writes into the buffer: no page-cache copy, a quarter of a
    conversion's CPU time otherwise)."""

    def __init__(self):
        self.buf: Optional[mmap.mmap] = None

    def read(self, path: Path, start: int, end: int) -> tuple[memoryview, torch.Tensor]:
        """Bytes [start, end) of ``path`` as a memoryview and a uint8 tensor over the same memory."""
        lo, hi = start // _ALIGN * _ALIGN, -(-end // _ALIGN) * _ALIGN
        if self.buf is None or len(self.buf) < hi - lo:
            self.buf = mmap.mmap(-1, hi - lo)
        view = memoryview(self.buf)
        got = -1
        if hasattr(os, "O_DIRECT"):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            except OSError:
                fd = -1
            if fd >= 0:
                try:
                    got = _pread_into(fd, view[:hi - lo], lo, path)
                except OSError:
                    got = -1
                finally:
                    os.close(fd)
        if got < end - lo:  # no O_DIRECT here: the page cache
            fd = os.open(path, os.O_RDONLY)
            try:
                got = _pread_into(fd, view[:end - start], start, path)
            finally:
                os.close(fd)
            lo = start
        if got < end - lo:
            raise OSError(f"{path}: truncated: bytes {start}..{end} are past its end")
        at = start - lo
        return view[at:at + end - start], torch.frombuffer(self.buf, dtype=torch.uint8)[at:at + end - start]


class DirectReader(FileSystemReader):
    """``FileSystemReader`` with metadata read once and whole-chunk tensor reads batched: the
    records of a plan are read in large sequential runs into two reused buffers (the next run on a
    thread while the current one's chunks are copied out), and each chunk's raw bytes are copied
    into its destination (no unpickling, no per-chunk stream)."""

    def __init__(self, path: str | Path, verifier=None):
        super().__init__(path)
        self._metadata = None
        self.verifier = verifier  # a manifest.StreamVerifier fed every run read (checksums from these bytes)
        self._runs = (_Runs(), _Runs())
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="glm5-dcp-read")

    def close(self) -> None:
        """Stop the read-ahead thread (the reader is not used after)."""
        self._pool.shutdown(wait=True)

    def read_metadata(self, *args, **kwargs):
        if self._metadata is None:
            self._metadata = super().read_metadata(*args, **kwargs)
        return self._metadata

    def _direct(self, req, planner) -> Optional[torch.Tensor]:
        """The destination of ``req`` when it is a whole stored chunk, contiguous, same dtype."""
        if req.type == LoadItemType.BYTE_IO or self.storage_data[req.storage_index].transform_descriptors:
            return None
        meta = self.read_metadata().state_dict_metadata[req.storage_index.fqn]
        chunk = next((c for c in meta.chunks if tuple(c.offsets) == tuple(req.storage_index.offset)), None)
        if chunk is None or any(o != 0 for o in req.storage_offsets) or tuple(req.lengths) != tuple(chunk.sizes):
            return None
        target = planner.resolve_tensor(req).detach()
        ok = target.is_contiguous() and target.dtype == meta.properties.dtype and target.device.type == "cpu"
        return target if ok else None

    def read_data(self, plan, planner):
        by_file: dict[str, list] = {}
        rest = []
        for req in plan.items:
            target = self._direct(req, planner)
            if target is None:
                rest.append(req)
            else:
                info = self.storage_data[req.storage_index]
                by_file.setdefault(info.relative_path, []).append((info.offset, info.length, req, target))
        runs = []  # (path, start, end, items): records close together, read in one go
        for rel, items in by_file.items():
            items.sort(key=lambda it: it[0])
            i = 0
            while i < len(items):
                start, end, j = items[i][0], items[i][0] + items[i][1], i + 1
                while j < len(items) and items[j][0] - end <= _GAP and items[j][0] + items[j][1] - start <= _PIECE:
                    end, j = items[j][0] + items[j][1], j + 1
                runs.append((Path(self.path) / rel, start, end, items[i:j]))
                i = j
        def fetch(buf: _Runs, path: Path, start: int, end: int):
            view, data_u8 = buf.read(path, start, end)
            if self.verifier is not None:  # hashed on the read-ahead thread, while chunks are copied out
                self.verifier.feed(path, start, view)
            return view, data_u8

        # run k+1 is read on a thread while run k's chunks are copied out (two buffers)
        ahead = self._pool.submit(fetch, self._runs[0], *runs[0][:3]) if runs else None
        for k, (path, start, end, items) in enumerate(runs):
            view, data_u8 = ahead.result()
            if k + 1 < len(runs):
                ahead = self._pool.submit(fetch, self._runs[(k + 1) % 2], *runs[k + 1][:3])
            for offset, length, req, target in items:
                at = offset - start
                data = raw_data_offset(view[at:at + length])
                nbytes = target.numel() * target.element_size()
                if data is None or data + nbytes > length:
                    rest.append(req)
                    continue
                target.reshape(-1).view(torch.uint8).copy_(data_u8[at + data: at + data + nbytes])
                planner.commit_tensor(req, target)
            del view, data_u8
        if rest:
            plan = type(plan)(items=rest, storage_data=plan.storage_data, planner_data=plan.planner_data)
            return super().read_data(plan, planner)
        fut: Future = Future()
        fut.set_result(None)
        return fut


def load_sharded(sharded: dict, reader: DirectReader) -> dict:
    """``dist_checkpointing.load`` of a (factory-free) sharded state dict's tensors, minus its
    common-state and validation steps: what ``TorchDistLoadShardedStrategy.load`` does, with
    ``reader``. Returns the loaded state dict (same keys as ``sharded``)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreLoadPlanner, _replace_sharded_keys_with_state_dict_keys, _replace_state_dict_keys_with_sharded_keys,
        _restore_dict_types, _unwrap_pyt_sharded_tensor, mcore_to_pyt_state_dict)
    from torch.distributed import checkpoint

    tensors = [t for t in nested_values(sharded) if isinstance(t, ShardedTensor)]
    by_key, flat_mapping, rename_mapping = _replace_state_dict_keys_with_sharded_keys(sharded)
    pyt = mcore_to_pyt_state_dict(by_key, True)
    checkpoint.load(pyt, reader, planner=MCoreLoadPlanner(
        shapes_validation_sharded_tensors=[t for t in tensors if not t.allow_shape_mismatch],
        allow_shape_mismatch_sharded_tensors={t.key: t for t in tensors if t.allow_shape_mismatch},
        flatten_state_dict=False, flatten_sharded_tensors=False), no_dist=True)
    loaded = {k: _unwrap_pyt_sharded_tensor(v) for k, v in pyt.items()}
    loaded = _replace_sharded_keys_with_state_dict_keys(loaded, flat_mapping, rename_mapping)
    _restore_dict_types(loaded, sharded)
    return loaded

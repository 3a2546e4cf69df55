"""The training device: one answer to "where do this rank's tensors live", used by the model build,
the SFT and RL data paths, the rollout engine and every collective's tensors; and its memory: ``device_memory``
figures, ``HostCopy`` (storages to host memory and back, for a colocated engine and the trainer's offload).

CUDA's current device under CUDA (set per rank by ``init_parallel`` from ``LOCAL_RANK``), else the
CPU. Tests override it (``training_device_override``) with a stand-in accelerator so that a tensor
created on the CPU where the device was meant fails on a CPU-only machine as it would on CUDA.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from typing import Callable, Iterable, Optional

import torch

_override: Optional[torch.device] = None


def training_device() -> torch.device:
    """Where parameters, batches and collective buffers of this rank live."""
    if _override is not None:
        return _override
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def training_device_override(device: torch.device | str):
    """Tests: ``training_device()`` returns ``device`` while active."""
    global _override
    prev, _override = _override, torch.device(device)
    try:
        yield _override
    finally:
        _override = prev


def to_device_async(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A small host tensor ``t`` on ``device`` without a host sync: under CUDA from pinned memory with
    ``non_blocking=True`` (a copy from pageable memory, or a blocking one, waits for the stream: ATen's
    ``memcpy_and_sync``). The pinned buffer is PyTorch's cached one, kept until the copy is done. ``t`` itself on
    the CPU."""
    device = torch.device(device)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def dist_timeout() -> datetime.timedelta:
    """The timeout of every process group this project creates: ``GLM5_DIST_TIMEOUT_MINUTES`` (default 30;
    Megatron-LM's ``--distributed-timeout-minutes``). PyTorch's NCCL default is 10 minutes, which a
    744B checkpoint's verification or load on a shared file system can outlast."""
    raw = os.environ.get("GLM5_DIST_TIMEOUT_MINUTES", "30")
    try:
        minutes = float(raw)
    except ValueError:
        raise ValueError(f"GLM5_DIST_TIMEOUT_MINUTES={raw!r}: a number of minutes") from None
    if minutes <= 0:
        raise ValueError(f"GLM5_DIST_TIMEOUT_MINUTES={raw!r}: must be > 0")
    return datetime.timedelta(minutes=minutes)


HOST_ALIGN = 4096
"""Byte alignment of each storage in a ``HostCopy`` arena (a page: DMA-friendly offsets)."""


class HostCopy:
    """The storages of ``tensors`` moved to host memory (their accelerator storage resized to 0, every view
    kept) and back, bit-identical. Storages shared by several tensors move once.

    ``tensors`` is a fixed collection, or a callable giving them at each offload: what a parameter stores can change
    between steps (a TE FP8 weight's column-wise copy is dropped and made again as new tensors), so a snapshot taken
    once would keep a dead copy (moved back to the device at every restore) and miss the live one.

    Host memory is ONE arena for all of them (each storage at a ``HOST_ALIGN``-aligned offset), made at the first
    offload and kept (made anew only if the tensors outgrow it), so every step reuses the same pages. Under CUDA it
    is pinned with ``cudaHostRegister`` on exactly its size, outside PyTorch's pinned caching allocator: that
    allocator rounds each request up to a power of two and caches the block (``CachingHostAllocator.h:300-309``),
    up to twice the frozen base when every storage has its own pinned buffer. ``host_bytes`` is what the arena
    holds."""

    def __init__(self, tensors: Iterable[torch.Tensor] | Callable[[], Iterable[torch.Tensor]]):
        self._resolve = tensors if callable(tensors) else None
        self.arena: Optional[torch.Tensor] = None
        self._registered = False
        self._out = False
        self._plan(tensors() if callable(tensors) else tensors)

    def _plan(self, tensors: Iterable[torch.Tensor]) -> None:
        seen, self.tensors = set(), []
        for t in tensors:
            key = t.untyped_storage().data_ptr()
            if key not in seen and t.untyped_storage().nbytes():
                seen.add(key)
                self.tensors.append(t)
        self.sizes = [t.untyped_storage().nbytes() for t in self.tensors]
        self.offsets, off = [], 0
        for n in self.sizes:
            self.offsets.append(off)
            off += -(-n // HOST_ALIGN) * HOST_ALIGN
        self.host_bytes = off

    @property
    def offloaded(self) -> bool:
        return self._out

    def _make_arena(self) -> torch.Tensor:
        arena = torch.empty(self.host_bytes, dtype=torch.uint8)
        cuda = torch.cuda.is_available() and any(t.untyped_storage().device.type == "cuda" for t in self.tensors)
        if cuda and self.host_bytes:
            err = torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), self.host_bytes, 0)
            self._registered = int(err) == 0
            if not self._registered:  # no page-locking (a container's memlock limit): PyTorch's pinned buffer
                arena = torch.empty(self.host_bytes, dtype=torch.uint8, pin_memory=True)
        return arena

    def offload(self) -> int:
        """Bytes moved to the host."""
        if self._out:
            raise RuntimeError("HostCopy.offload: already offloaded")
        if self._resolve is not None:
            self._plan(self._resolve())
        if self.arena is None or self.arena.numel() < self.host_bytes:
            self._free_arena()
            self.arena = self._make_arena()
        for t, off, n in zip(self.tensors, self.offsets, self.sizes):
            st = t.untyped_storage()
            dev = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)
            self.arena[off: off + n].copy_(dev, non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for t in self.tensors:
            t.untyped_storage().resize_(0)
        self._out = True
        return sum(self.sizes)

    def restore(self) -> int:
        """Bytes moved back."""
        if not self._out:
            raise RuntimeError("HostCopy.restore: nothing offloaded")
        for t, off, n in zip(self.tensors, self.offsets, self.sizes):
            st = t.untyped_storage()
            st.resize_(n)
            torch.empty(0, dtype=torch.uint8, device=st.device).set_(st).copy_(self.arena[off: off + n],
                                                                              non_blocking=True)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self._out = False
        return sum(self.sizes)

    def _free_arena(self) -> None:
        if self._registered and self.arena is not None:
            torch.cuda.cudart().cudaHostUnregister(self.arena.data_ptr())
        self.arena, self._registered = None, False

    def __del__(self):
        self._free_arena()


def device_memory() -> dict:
    """{"allocated_gib", "reserved_gib"} of the current CUDA device ({} on CPU)."""
    if not torch.cuda.is_available():
        return {}
    g = float(1 << 30)
    return {"allocated_gib": torch.cuda.memory_allocated() / g, "reserved_gib": torch.cuda.memory_reserved() / g}

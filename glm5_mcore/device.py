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
from typing import Iterable, Optional

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


class HostCopy:
    """The storages of ``tensors`` moved to host memory (their accelerator storage resized to 0, every view
    kept) and back, bit-identical. Storages shared by several tensors move once."""

    def __init__(self, tensors: Iterable[torch.Tensor]):
        seen, self.tensors = set(), []
        for t in tensors:
            key = t.untyped_storage().data_ptr()
            if key not in seen and t.untyped_storage().nbytes():
                seen.add(key)
                self.tensors.append(t)
        self.host: list = []

    @property
    def offloaded(self) -> bool:
        return bool(self.host)

    def offload(self) -> int:
        """Bytes moved to the host."""
        if self.host:
            raise RuntimeError("HostCopy.offload: already offloaded")
        moved = 0
        for t in self.tensors:
            st = t.untyped_storage()
            dev = torch.empty(0, dtype=torch.uint8, device=st.device).set_(st)
            host = torch.empty(st.nbytes(), dtype=torch.uint8, pin_memory=torch.cuda.is_available() and st.device.type == "cuda")
            host.copy_(dev, non_blocking=True)
            self.host.append(host)
            moved += st.nbytes()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        for t in self.tensors:
            t.untyped_storage().resize_(0)
        return moved

    def restore(self) -> int:
        """Bytes moved back."""
        if not self.host:
            raise RuntimeError("HostCopy.restore: nothing offloaded")
        moved = 0
        for t, host in zip(self.tensors, self.host):
            st = t.untyped_storage()
            st.resize_(host.numel())
            torch.empty(0, dtype=torch.uint8, device=st.device).set_(st).copy_(host, non_blocking=True)
            moved += host.numel()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.host = []
        return moved


def device_memory() -> dict:
    """{"allocated_gib", "reserved_gib"} of the current CUDA device ({} on CPU)."""
    if not torch.cuda.is_available():
        return {}
    g = float(1 << 30)
    return {"allocated_gib": torch.cuda.memory_allocated() / g, "reserved_gib": torch.cuda.memory_reserved() / g}

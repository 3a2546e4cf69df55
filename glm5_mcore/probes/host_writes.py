"""Count host→device copies under ``fake_device`` (``glm5_mcore/probes/fake_device.py``), and which of them would
block the host on CUDA: ``torch.tensor(data, device=dev)`` (built on the host, then a blocking copy),
``.to(dev)`` / ``copy_`` from a CPU tensor without ``non_blocking=True`` (ATen's ``memcpy_and_sync`` waits for the
stream). A ``non_blocking=True`` copy is counted as an upload only: CUDA makes it asynchronous when its source is
pinned, which the caller's CUDA branch does (``glm5_mcore.device.to_device_async``; the CPU cannot pin).
``HostWrites.blocking`` / ``uploads`` list (what, the project/Megatron frame that asked)."""

from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_flatten

from glm5_mcore.probes import fake_device
from glm5_mcore.probes.fake_device import OnDevice
from glm5_mcore.probes.host_reads import project_caller

aten = torch.ops.aten


class HostWrites:
    """Where ``count_host_writes`` records: ``uploads`` every host→device copy, ``blocking`` those that wait."""

    def __init__(self):
        self.uploads: list[tuple[str, str]] = []
        self.blocking: list[tuple[str, str]] = []

    def _hit(self, what: str, blocks: bool) -> None:
        rec = (what, project_caller())
        self.uploads.append(rec)
        if blocks:
            self.blocking.append(rec)

    def check(self, func, args, kwargs):
        if func in (torch.tensor, torch.as_tensor):
            self._hit(f"torch.{func.__name__}(host data, device)", True)
            return
        if func is aten._to_copy.default:
            src = args[0]
            to = kwargs.get("device")
            if to is not None and torch.device(to) == fake_device.META and not isinstance(src, OnDevice) \
                    and src.dim() > 0:
                self._hit(str(func), not kwargs.get("non_blocking", False))
            return
        if func is aten.copy_.default and isinstance(args[0], OnDevice):
            flat, _ = tree_flatten(args[1])
            src = flat[0] if flat else None
            if isinstance(src, torch.Tensor) and not isinstance(src, OnDevice) and src.dim() > 0:
                non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
                self._hit(str(func), not non_blocking)


@contextlib.contextmanager
def count_host_writes():
    """Inside ``fake_device()``: yields a ``HostWrites`` that grows with each host→device copy (any thread)."""
    rec = HostWrites()
    fake_device.OBSERVERS.append(rec.check)
    try:
        yield rec
    finally:
        fake_device.OBSERVERS.remove(rec.check)

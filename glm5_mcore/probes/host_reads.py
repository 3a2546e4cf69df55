"""Count device→host reads under ``fake_device`` (``glm5_mcore/probes/fake_device.py``): every op that on CUDA
waits for the device to hand a value to the host (``.item()``, ``int()``, ``bool()``, ``.tolist()``,
``nonzero``, ``masked_select``, ``unique``, indexing with a boolean mask, a device→CPU copy), when one of its arguments is a device
tensor. ``HostReads.reads`` lists (op, the project/Megatron frame that asked); ``raise_on_read``
turns the first one into an error naming it."""

from __future__ import annotations

import contextlib
import traceback

import torch
from torch.utils._pytree import tree_flatten

from glm5_mcore.probes import fake_device
from glm5_mcore.probes.fake_device import OnDevice

aten = torch.ops.aten
SYNC_OPS = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.nonzero.default,
            aten.masked_select.default, aten._unique2.default, aten.unique_consecutive.default,
            aten.unique_dim.default, aten.equal.default, aten.repeat_interleave.Tensor}


BOOL_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


def project_caller() -> str:
    """file:line of the innermost project / Megatron frame on the stack (outside the probes)."""
    for fr in reversed(traceback.extract_stack()[:-3]):
        f = fr.filename
        if ("glm5_mcore" in f or "megatron" in f or "/rl/" in f or "/recipes/" in f) and "/probes/" not in f:
            return f"{f.split('site-packages/')[-1].split('/wt/')[-1]}:{fr.lineno}"
    return "?"


class HostReads:
    """Where ``count_host_reads`` records the reads (``active`` False pauses it)."""

    def __init__(self, raise_on_read: bool = False):
        self.reads: list[tuple[str, str]] = []
        self.raise_on_read = raise_on_read
        self.active = True

    def hit(self, what: str):
        if not self.active:
            return
        self.reads.append((what, project_caller()))
        if self.raise_on_read:
            raise AssertionError(f"device→host read {what} at {self.reads[-1][1]}")

    def check(self, func, args, kwargs):
        flat, _ = tree_flatten((args, kwargs))
        if not any(isinstance(t, OnDevice) for t in flat):
            return
        to_cpu = ((func is aten._to_copy.default and str(kwargs.get("device", "")) == "cpu")
                  or (func is aten.copy_.default and not isinstance(args[0], OnDevice)))
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None:
            return  # the output length given: CUDA's kernel needs no count back (no sync)
        if func in BOOL_INDEX_OPS and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                                          for i in (args[1] if len(args) > 1 else ()) or ()):
            self.hit(f"{func} (boolean mask)")  # CUDA counts the mask's True entries on the host first
            return
        if func in SYNC_OPS or to_cpu:
            self.hit(str(func))


@contextlib.contextmanager
def count_host_reads(raise_on_read: bool = False):
    """Inside ``fake_device()``: yields a ``HostReads`` whose ``reads`` grows with each host read. It
    observes ``fake_device.OBSERVERS``, which every op on a device tensor reaches, in any thread (the
    autograd engine runs a device's backward in its own thread, outside thread-local modes)."""
    rec = HostReads(raise_on_read)
    real_tolist = OnDevice.tolist

    def tolist(self):
        rec.hit("tolist")
        return real_tolist(self)

    OnDevice.tolist = tolist
    fake_device.OBSERVERS.append(rec.check)
    try:
        yield rec
    finally:
        OnDevice.tolist = real_tolist
        fake_device.OBSERVERS.remove(rec.check)

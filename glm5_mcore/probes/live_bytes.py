"""Live tensor bytes and their peak inside a block, as an accelerator's caching allocator would see them
with no fragmentation: a ``TorchDispatchMode`` that books every storage an op returns (once per
storage: views and in-place results add nothing) and frees it when the storage dies (a ``weakref``
finalizer on the storage). Works on the meta device and under ``FakeTensorMode`` (nothing is
allocated), so full-width shapes cost seconds. The storages of ``outside`` (the inputs, the parameters) and views of them are not counted.

``LiveBytes.at_peak`` lists what was alive at the peak (shape, dtype, bytes, the op that made it), largest
first, for the failure message."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """``outside``: tensors made before the block whose views ops may return (inputs, parameters).
    ``now``: bytes alive that ops inside the block made; ``peak``: their maximum (``reset_peak`` restarts
    it from ``now``); ``phase``: a label the caller sets, recorded with the peak (``peak_phase``)."""

    def __init__(self, outside=(), keep_peak_list: bool = True):
        super().__init__()
        self.now = self.peak = 0
        self.phase = self.peak_phase = ""
        self._live: dict[int, tuple | None] = {}  # storage -> (shape, dtype, bytes, op, phase); None: made outside
        self._keep = keep_peak_list
        self._at_peak: list[tuple] = []
        for t in outside:
            self._outside(t)

    @property
    def at_peak(self) -> list[tuple]:
        """(shape, dtype, bytes, op, phase) of every storage alive at the peak, largest first."""
        return sorted(self._at_peak, key=lambda r: -r[2])

    def reset_peak(self) -> None:
        self.peak = self.now

    def _free(self, key: int, nbytes: int) -> None:
        self._live.pop(key, None)
        self.now -= nbytes

    def _book(self, t: torch.Tensor, func) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self._live:
            return
        nbytes = st.nbytes()
        self._live[key] = (tuple(t.shape), str(t.dtype).replace("torch.", ""), nbytes, str(func), self.phase)
        self.now += nbytes
        weakref.finalize(st, self._free, key, nbytes)
        if self.now > self.peak:
            self.peak, self.peak_phase = self.now, self.phase
            if self._keep:
                self._at_peak = [r for r in self._live.values() if r is not None]

    def _outside(self, t: torch.Tensor) -> None:
        """A storage made before the block (an input, a parameter): views of it add nothing."""
        st = t.untyped_storage()
        key = st._cdata
        if key not in self._live:
            self._live[key] = None
            weakref.finalize(st, self._live.pop, key, None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self._book(t, func)
        return out

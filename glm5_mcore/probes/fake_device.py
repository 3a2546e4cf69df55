"""A stand-in accelerator for CPU tests: tensors that say they live on the ``meta`` device but carry
real CPU values, so device bugs that only CUDA would show fail here too.

``fake_device()`` makes ``glm5_mcore.device.training_device()`` return ``meta`` and, while active,

- every tensor made on ``meta`` (a factory given ``device=meta``, ``.to("meta")``, ``new_*`` of a
  device tensor) is an ``OnDevice`` tensor: a wrapper reporting ``device == meta`` around a CPU
  tensor holding the values, so host reads (``.tolist()``, ``.item()``: a sync on CUDA) still work;
- an op mixing an ``OnDevice`` tensor with a plain CPU tensor of one or more dimensions raises
  ``DeviceMixError`` naming the op, as CUDA does ("Expected all tensors to be on the same device").
  CPU 0-dim tensors (CUDA takes them as scalars), host <-> device copies and CPU index tensors
  are allowed, as on CUDA.

``assert_collectives_on(device)`` wraps ``torch.distributed``'s collectives: every tensor handed to
one must be on ``device`` (NCCL rejects CPU tensors); values then go through gloo on the CPU.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

META = torch.device("meta")
aten = torch.ops.aten

# ops CUDA runs with CPU tensors among the arguments (copies across devices, CPU indices)
_MIX_OK = {aten.copy_.default, aten._to_copy.default, aten.index.Tensor, aten.index_put_.default,
           aten._index_put_impl_.default, aten.index_put.default, aten._copy_from.default,
           aten._copy_from_and_resize.default, aten.set_.source_Tensor}


class DeviceMixError(RuntimeError):
    pass


class OnDevice(torch.Tensor):
    """A CPU tensor reporting ``device == meta`` (see the module docstring)."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor, requires_grad: bool = False):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.size(), strides=elem.stride(),
                                                storage_offset=elem.storage_offset(), dtype=elem.dtype,
                                                layout=elem.layout, device=META, requires_grad=requires_grad)
        r.elem = elem
        return r

    def __repr__(self):
        return f"OnDevice({self.elem!r})"

    def tolist(self):  # a host read (a sync on CUDA); torch refuses .tolist() on subclasses
        return self.elem.tolist()

    def __tensor_flatten__(self):
        return ["elem"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return OnDevice(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


def _is_meta_arg(d) -> bool:
    return d is not None and torch.device(d).type == "meta"


OBSERVERS: list = []
"""Callables ``(func, args, kwargs)`` shown every op that reaches the stand-in device, in any thread, and every
``torch.tensor`` / ``torch.as_tensor`` of host data made on it (``host_reads`` counts device→host reads through it,
``host_writes`` the host→device copies)."""


def _dispatch(func, args, kwargs):
    for observe in OBSERVERS:
        observe(func, args, kwargs)
    flat, _ = tree_flatten((args, kwargs))
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    on_dev = any(isinstance(t, OnDevice) for t in tensors)
    to_meta = _is_meta_arg(kwargs.get("device"))
    if on_dev and func not in _MIX_OK:
        cpu = [t for t in tensors if not isinstance(t, OnDevice) and t.device.type == "cpu" and t.dim() > 0]
        if cpu:
            raise DeviceMixError(f"{func}: CPU tensor {tuple(cpu[0].shape)} {cpu[0].dtype} mixed with device tensors "
                                 "(CUDA would raise 'Expected all tensors to be on the same device')")
    if not on_dev and not to_meta:
        return func(*args, **kwargs)
    if func is aten.copy_.default:  # host <-> device copies: the destination keeps its kind
        dst, src = args[0], args[1]
        (dst.elem if isinstance(dst, OnDevice) else dst).copy_(src.elem if isinstance(src, OnDevice) else src,
                                                              *args[2:])
        return dst
    un = lambda t: t.elem if isinstance(t, OnDevice) else t  # noqa: E731
    ukw = dict(tree_map(un, kwargs))
    if to_meta:
        ukw["device"] = torch.device("cpu")
    out = func(*tree_map(un, args), **ukw)
    dev_out = d if (d := kwargs.get("device")) is not None else (META if on_dev else None)
    if dev_out is not None and torch.device(dev_out).type != "meta":
        return out  # e.g. .to("cpu") / .cpu() of a device tensor
    schema = func._schema
    if not schema.returns:
        return None
    if schema.arguments and schema.arguments[0].alias_info is not None and schema.arguments[0].alias_info.is_write:
        return args[0]  # in place: the wrapper whose values were written (views alias through ``elem``)
    if "out" in kwargs:
        return kwargs["out"]
    return tree_map(lambda t: OnDevice(t) if isinstance(t, torch.Tensor) else t, out)


class _Factories(TorchFunctionMode):
    """``torch.tensor(data, device=meta)`` fills a meta tensor below the dispatcher (no values):
    build it on the CPU and wrap it."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor):
            args = tree_map(host, args)  # device scalars in a list are read on the host, as CUDA does
            if _is_meta_arg(kwargs.get("device")):  # CUDA builds it on the host and copies it over, blocking
                for observe in OBSERVERS:
                    observe(func, args, kwargs)
                return OnDevice(func(*args, **{**kwargs, "device": "cpu"}))
        return func(*args, **kwargs)


class _Mode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return _dispatch(func, args, kwargs or {})


def _swap_keeping_attributes(real_swap):
    """``Module._apply`` swaps a parameter with its moved copy for wrapper subclasses, which also swaps
    ``__dict__``; on CUDA ``param.data = moved`` keeps Megatron's parameter attributes
    (``tensor_model_parallel``, ``sequence_parallel``, ...): keep them here too."""

    @functools.wraps(real_swap)
    def swap(t1, t2):
        keep = {k: v for k, v in t1.__dict__.items() if k != "elem"}
        real_swap(t1, t2)
        t1.__dict__.update(keep)

    return swap


def _viewless_keeping_values(real):
    """megatron/core/utils.py:731 makes a viewless tensor as ``empty((1,))`` then ``out.data = inp.data``,
    which swaps the wrapper's metadata but not its ``elem``: wrap the same values instead."""

    @functools.wraps(real)
    def viewless(inp, requires_grad):
        if isinstance(inp, OnDevice):
            return OnDevice(inp.elem, requires_grad=requires_grad)
        return real(inp, requires_grad)

    return viewless


@contextlib.contextmanager
def fake_device():
    """The training device is ``meta`` (values on the CPU) while active; see the module docstring."""
    from megatron.core import utils as mutils

    from glm5_mcore import device

    real_swap, real_viewless = torch.utils.swap_tensors, mutils._kernel_make_viewless_tensor
    torch.utils.swap_tensors = _swap_keeping_attributes(real_swap)
    mutils._kernel_make_viewless_tensor = _viewless_keeping_values(real_viewless)
    try:
        with device.training_device_override(META), _Factories(), _Mode():
            yield META
    finally:
        torch.utils.swap_tensors = real_swap
        mutils._kernel_make_viewless_tensor = real_viewless


def host(t):
    """The CPU values of a (possibly) device tensor."""
    return t.elem if isinstance(t, OnDevice) else t


_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
                "reduce", "all_to_all_single", "_all_gather_base", "_reduce_scatter_base", "gather", "scatter")


@contextlib.contextmanager
def assert_collectives_on(device: torch.device | str, seen: list | None = None, violations: list | None = None):
    """Wrap ``torch.distributed``'s collectives (where the project and Megatron-Core call them): every
    tensor argument must be on ``device`` (AssertionError naming the collective and the caller, or
    appended to ``violations`` when given, so one run lists them all). ``seen`` collects
    (collective, caller) pairs. Device tensors travel through gloo as their CPU values."""
    import inspect

    device = torch.device(device)
    originals = {n: getattr(dist, n) for n in _COLLECTIVES if hasattr(dist, n)}

    def wrap(name, real):
        @functools.wraps(real)
        def checked(*args, **kwargs):
            frame = inspect.currentframe().f_back
            while frame.f_code.co_filename == __file__ or (  # wrappers, torch-function dispatch
                    "/torch/" in frame.f_code.co_filename and "/torch/distributed/" not in frame.f_code.co_filename):
                frame = frame.f_back
            path = frame.f_code.co_filename
            where = f"{path.split('site-packages/')[-1].split('/wt/')[-1]}:{frame.f_lineno}"
            if "torch/distributed/" in path:  # *_object collectives choose their own buffer device
                return real(*tree_map(host, args), **tree_map(host, kwargs))
            flat, _ = tree_flatten((args, kwargs))
            for t in flat:
                if isinstance(t, torch.Tensor) and t.device.type != device.type:
                    msg = (f"dist.{name} at {where}: tensor {tuple(t.shape)} on {t.device}, "
                           f"not the training device {device}")
                    if violations is None:
                        raise AssertionError(msg)
                    violations.append(msg)
                    break
            if seen is not None:
                seen.append((name, where))
            return real(*tree_map(host, args), **tree_map(host, kwargs))

        return checked

    mods = [dist, dist.distributed_c10d]
    patched = []
    import sys

    for mod in list(sys.modules.values()):  # also the names imported with ``from torch.distributed import ...``
        name = getattr(mod, "__name__", "") or ""
        if name.startswith(("megatron", "glm5_mcore", "recipes", "rl")) and mod not in mods:
            mods.append(mod)
    for mod in mods:
        for n, real in originals.items():
            if getattr(mod, n, None) is real:
                patched.append((mod, n, real))
                setattr(mod, n, wrap(n, real))
    try:
        yield seen
    finally:
        for mod, n, real in patched:
            setattr(mod, n, real)

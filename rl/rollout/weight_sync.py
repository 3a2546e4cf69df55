"""Weight sync to a colocated engine without a file in between: tensors packed into flat buckets, each
bucket handed over as a handle to its memory (CUDA IPC on GPUs, as verl's and slime's colocated paths
do: ``update_weights_from_tensor`` / ``FlattenedTensorBucket``), rebuilt as views on the other side and
loaded one bucket at a time. Separate engines keep the safetensors-file path (``VLLMRolloutEngine._push``).

- ``plan_buckets``: names → buckets of at most ``max_bytes``, whole groups per bucket (a vLLM module
  is rebuilt from what one ``reload_weights`` call brings: ``vllm_weights.vllm_module_tensors``), in the
  order given; a group larger than ``max_bytes`` is a bucket of its own.
- ``pack`` / ``unpack``: a bucket as one uint8 buffer + ``TensorMeta`` (name, dtype, shape, byte offset,
  ``ALIGN``-aligned), and back as views, bit-identical for every dtype (FP8 e4m3 and its fp32 scales too).
- ``Codec``: ``export(buffer) -> handle`` (picklable), ``open(handle) -> buffer`` in the receiving process,
  ``release(handle)`` once it is loaded. ``CudaIPC``: ``torch.multiprocessing.reductions.reduce_tensor``
  (the CUDA IPC handle; the receiver rebuilds it on its own device index). ``SharedFile``: the CPU
  stand-in with the same protocol, a file-backed shared storage under ``/dev/shm``, so the bucketing,
  ordering and handle round trip run on a CPU; the CUDA-IPC call itself is the GPU stage's
  (``bench/gpu_check_colocate.py``).

This module imports only torch: the vLLM side (``rl.rollout.vllm_server``, another interpreter) uses it.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

import torch

ALIGN = 256
"""Byte alignment of each tensor in a bucket (any dtype view is aligned; CUDA's allocator uses 512)."""


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: str
    """``torch.float8_e4m3fn`` → "float8_e4m3fn"."""
    shape: tuple
    offset: int
    nbytes: int


def _dtype(name: str) -> torch.dtype:
    d = getattr(torch, name, None)
    if not isinstance(d, torch.dtype):
        raise ValueError(f"weight sync: unknown dtype {name!r}")
    return d


def plan_buckets(sizes: dict, max_bytes: int, group_of: Callable[[str], str] = lambda n: n) -> list[list[str]]:
    """``sizes``: name → bytes, in push order. Buckets of names, each group (``group_of(name)``) whole and
    where its first member came; at most ``max_bytes`` per bucket unless one group is larger."""
    if max_bytes < 1:
        raise ValueError(f"weight sync: bucket size {max_bytes} must be >= 1 byte")
    groups: dict[str, list[str]] = {}
    for n in sizes:
        groups.setdefault(group_of(n), []).append(n)
    buckets, cur, size = [], [], 0
    for members in groups.values():
        g = sum(-(-sizes[n] // ALIGN) * ALIGN for n in members)
        if cur and size + g > max_bytes:
            buckets.append(cur)
            cur, size = [], 0
        cur = cur + members
        size += g
    if cur:
        buckets.append(cur)
    return buckets


def pack(tensors: dict, names: list[str], device: Optional[torch.device] = None) -> tuple[torch.Tensor, list]:
    """One uint8 buffer on ``device`` (default: the first tensor's) holding ``names`` in order, and their metas."""
    metas, off = [], 0
    for n in names:
        t = tensors[n]
        nb = t.numel() * t.element_size()
        metas.append(TensorMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape), off, nb))
        off += -(-nb // ALIGN) * ALIGN
    dev = device if device is not None else (tensors[names[0]].device if names else torch.device("cpu"))
    flat = torch.empty(off, dtype=torch.uint8, device=dev)
    for m in metas:
        t = tensors[m.name].contiguous()
        flat[m.offset: m.offset + m.nbytes].copy_(t.reshape(-1).view(torch.uint8))
    return flat, metas


def unpack(flat: torch.Tensor, metas: list) -> list[tuple[str, torch.Tensor]]:
    """(name, view into ``flat``) in bucket order."""
    out = []
    for m in metas:
        if m.offset + m.nbytes > flat.numel():
            raise ValueError(f"weight sync: tensor {m.name} [{m.offset}, {m.offset + m.nbytes}) is past the "
                             f"bucket's {flat.numel()} bytes")
        out.append((m.name, flat[m.offset: m.offset + m.nbytes].view(_dtype(m.dtype)).view(m.shape)))
    return out


class Codec:
    name = "base"

    def export(self, flat: torch.Tensor):
        raise NotImplementedError

    def open(self, handle) -> torch.Tensor:
        raise NotImplementedError

    def release(self, handle) -> None:
        pass


class CudaIPC(Codec):
    """A CUDA buffer as its IPC handle (``reduce_tensor``: (rebuild function, args)); the receiver
    rebuilds it on its current device (the same GPU under another index in its own
    ``CUDA_VISIBLE_DEVICES``, args[6] as verl's ``rebuild_ipc`` sets it). The sender keeps ``flat`` alive
    until ``release``."""
    name = "cuda_ipc"

    def __init__(self):
        self._alive: dict[int, torch.Tensor] = {}

    def export(self, flat: torch.Tensor):
        from torch.multiprocessing.reductions import reduce_tensor

        if flat.device.type != "cuda":
            raise ValueError("CudaIPC.export: the bucket must be on a CUDA device")
        fn, args = reduce_tensor(flat)
        key = id(flat)
        self._alive[key] = flat
        return (key, fn, args)

    def open(self, handle) -> torch.Tensor:
        _, fn, args = handle
        args = list(args)
        args[6] = torch.cuda.current_device()
        return fn(*args)

    def release(self, handle) -> None:
        self._alive.pop(handle[0], None)


class SharedFile(Codec):
    """The CPU stand-in: the bucket copied into a file-backed shared storage in ``/dev/shm`` (handle:
    (path, bytes)); the receiver maps the same file. The sender removes the file on ``release``."""
    name = "shared_file"

    def __init__(self, root: Optional[str] = None):
        self.root = root or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())

    def export(self, flat: torch.Tensor):
        path = os.path.join(self.root, f"glm5_bucket_{os.getpid()}_{uuid.uuid4().hex}")
        n = flat.numel()
        st = torch.UntypedStorage.from_file(path, shared=True, nbytes=max(n, 1))
        torch.empty(0, dtype=torch.uint8).set_(st)[:n].copy_(flat.cpu())
        return (path, n)

    def open(self, handle) -> torch.Tensor:
        path, n = handle
        st = torch.UntypedStorage.from_file(path, shared=True, nbytes=max(n, 1))
        return torch.empty(0, dtype=torch.uint8).set_(st)[:n]

    def release(self, handle) -> None:
        try:
            os.unlink(handle[0])
        except FileNotFoundError:
            pass


CODECS = {c.name: c for c in (CudaIPC, SharedFile)}


def codec(name: str) -> Codec:
    if name not in CODECS:
        raise ValueError(f"weight sync: codec {name!r}: one of {sorted(CODECS)}")
    return CODECS[name]()


def send(chunks: Iterable[dict], max_bytes: int, codec_: Codec, receive: Callable, group_of=lambda n: n,
         device: Optional[torch.device] = None) -> list[dict]:
    """Every tensor of ``chunks`` (dicts name → tensor, in order) to ``receive(handle, metas)``, bucket by
    bucket (one in flight: the sender's extra memory is one bucket, freed before the next is packed, and on CUDA
    the caching allocator's blocks are released after the push, so the rollout actor holds nothing between pushes:
    ``plan.colocate.SYNC_BUCKET``); returns per bucket {"names", "bytes"}."""
    sent = []
    try:
        for chunk in chunks:
            sizes = {n: t.numel() * t.element_size() for n, t in chunk.items()}
            for names in plan_buckets(sizes, max_bytes, group_of):
                flat, metas = pack(chunk, names, device)
                handle = codec_.export(flat)
                try:
                    receive(handle, metas)
                finally:
                    codec_.release(handle)
                sent.append({"names": names, "bytes": int(flat.numel())})
                del flat, handle  # freed before the next bucket is packed: one bucket in memory at a time
    finally:
        if device is not None and device.type == "cuda":
            torch.cuda.empty_cache()  # the sender's cached blocks back to the engine (the planner counts one bucket)
    return sent


def receive(handle, metas: list, codec_name: str) -> list[tuple[str, torch.Tensor]]:
    """The receiving side: the bucket behind ``handle`` as (name, tensor) views."""
    return unpack(codec(codec_name).open(handle), metas)


def byte_sums(named) -> list[tuple[str, int, int]]:
    """(name, sum of its bytes, byte count) per (name, tensor): a bit-level fingerprint of a bucket."""
    return [(n, int(t.contiguous().view(torch.uint8).cpu().long().sum()), t.numel() * t.element_size())
            for n, t in named]


def read_back(handle, metas: list, codec_name: str, queue) -> None:
    """A receiving process (``round_trip``'s child): the bucket's ``byte_sums`` onto ``queue``. Module-level,
    so a ``spawn`` child can unpickle it by name (a function of a module loaded by path cannot)."""
    if codec_name == "cuda_ipc":
        torch.cuda.set_device(0)
    queue.put(byte_sums(receive(handle, metas, codec_name)))


def round_trip(tensors: dict, codec_name: str, timeout: float = 120.0) -> dict:
    """``tensors`` packed into one bucket, exported with ``codec_name`` and read in a spawned process:
    {"ok": its fingerprints equal the sender's, "bytes", "tensors"} (the GPU check of CUDA IPC; the CPU
    tests run it with ``shared_file``)."""
    import torch.multiprocessing as mp

    flat, metas = pack(tensors, list(tensors))
    c = codec(codec_name)
    handle = c.export(flat)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=read_back, args=(handle, metas, codec_name, q))
    p.start()
    try:
        got = q.get(timeout=timeout)
    finally:
        p.join(60)
        c.release(handle)
    return {"ok": got == byte_sums(tensors.items()), "bytes": int(flat.numel()), "tensors": len(got)}

"""The Megatron-Core checkpoint write half of conversion (``hf-to-mcore``), beside its read half
``dcp_read``.

``lazy_dcp_save`` runs Megatron-Core's own torch_dist save (``sharded_state_dict``, sharded keys,
PyTorch-DCP translation, ``MCoreSavePlanner``) on a meta-device model, and a planner makes each write
item's tensor only when the writer reaches it, from a ``source`` with ``resolve(view) -> tensor`` and
``position(view) -> (file, offset)`` (where its source bytes lie; ``convert._HFSourcePlan``). Items
go into the data files in source order (``source_order_writer``), written past the page cache
(``direct_io.DirectWriter``); with one writer thread a ``_Prefetcher`` makes tensors ahead of it, at
most a byte budget ahead. Peak memory is the items in flight, not the model.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from pathlib import Path
from typing import Callable, Optional

import torch

from glm5_mcore.checkpoint.checks import NonFiniteError
from glm5_mcore.checkpoint.direct_io import DirectWriter
from glm5_mcore.checkpoint.fp8_sharded import fp8_sharded_state_dict


class _Prefetcher:
    """Makes the write items' tensors on a background thread, in the order the writer will ask for
    them and at most ``budget`` bytes ahead, so reading the HF files (``preadv`` releases the GIL)
    overlaps writing the checkpoint. ``get`` must follow that order."""

    def __init__(self, keys: list, make: Callable, budget: int):
        self.keys, self.make, self.budget = keys, make, budget
        self.ready: dict = {}
        self.held = 0
        self.next = 0
        self.error: Optional[BaseException] = None
        self.stop = False
        self.cv = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="glm5-convert-prefetch", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for k in self.keys:
                with self.cv:
                    while self.held >= self.budget and not self.stop:
                        self.cv.wait()
                    if self.stop:
                        return
                t = self.make(k)
                with self.cv:
                    self.ready[k] = t
                    self.held += t.numel() * t.element_size()
                    self.cv.notify_all()
        except BaseException as e:  # noqa: BLE001 - handed to the writer thread in get()
            with self.cv:
                self.error = e
                self.cv.notify_all()

    def get(self, k) -> torch.Tensor:
        with self.cv:
            if self.next >= len(self.keys) or self.keys[self.next] != k:
                raise RuntimeError(f"write item {k} requested out of the prefetch order")
            self.next += 1
            while k not in self.ready and self.error is None:
                self.cv.wait()
            if k not in self.ready:
                raise self.error
            t = self.ready.pop(k)
            self.held -= t.numel() * t.element_size()
            self.cv.notify_all()
            return t

    def close(self) -> None:
        with self.cv:
            self.stop = True
            self.cv.notify_all()
        self.thread.join()


def source_order_writer(out: Path, workers: int, order_key: Callable):
    """DCP's ``FileSystemWriter`` with two changes for conversion: data files are written through
    ``DirectWriter`` (past the page cache), and items go into the files sorted by ``order_key`` (where
    their source bytes lie), split into ``workers`` contiguous runs, instead of largest first. Read
    in that order the HF shards stream front to back; and as HF files keep each layer's tensors
    together, so does the checkpoint, which a layer-at-a-time reader (``mcore-to-hf``) then reads
    in runs. With one worker the items' tensors are made ahead of the writer by a ``_Prefetcher``."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, FileSystem
    from torch.distributed.checkpoint.planner import WriteItemType

    class DirectDataFileSystem(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path, mode):
            if mode == "wb" and str(path).endswith(DEFAULT_SUFFIX):
                with DirectWriter(path) as stream:
                    yield stream
            else:
                with super().create_stream(path, mode) as stream:
                    yield stream

    class SourceOrderWriter(FileSystemWriter):
        def write_data(self, plan, planner):
            byte_items = [it for it in plan.items if it.type == WriteItemType.BYTE_IO]
            tensor_items = sorted((it for it in plan.items if it.type != WriteItemType.BYTE_IO), key=order_key)
            sizes = [it.tensor_data.chunk.sizes.numel() * it.tensor_data.properties.dtype.itemsize
                     for it in tensor_items]
            share, buckets, acc = max(1, sum(sizes)) / self.thread_count, [list(byte_items)], 0
            for it, nb in zip(tensor_items, sizes):
                if acc >= share * len(buckets) and len(buckets) < self.thread_count:
                    buckets.append([])
                buckets[-1].append(it)
                acc += nb
            if self.thread_count == 1 and planner.prefetch_bytes > 0:
                planner.start_prefetch(buckets[0])
            file_queue: queue.Queue = queue.Queue()
            for i, bucket in enumerate(buckets):
                name = f"{plan.storage_data.prefix}{i}{DEFAULT_SUFFIX}"
                file_queue.put((self.fs.concat_path(self.path, name), name, bucket))
            return self._write_data(planner, file_queue)

    writer = SourceOrderWriter(str(out), single_file_per_rank=True, thread_count=max(1, workers), sync_files=False)
    writer.fs = DirectDataFileSystem()
    return writer


def lazy_dcp_save(model, out: Path, source, workers: int, on_item: Callable[[int], None],
                   prefetch_budget: int = 256 << 20) -> None:
    """Megatron-Core's torch_dist save of ``model.sharded_state_dict()`` (a frozen FP8 base as its stored pairs,
    ``checkpoint.fp8_sharded``) with data made on demand by
    ``source.resolve(view)``, written in ``source.position(view)`` order."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, _replace_state_dict_keys_with_sharded_keys, mcore_to_pyt_state_dict)
    from torch.distributed.checkpoint.planner import WriteItemType

    sharded, common = save_preprocess(fp8_sharded_state_dict(model.sharded_state_dict()),
                                      validate_access_integrity=False)
    sharded["common_state"] = ShardedObject("common_state", common, (1,), (0,), replica_id=0)
    by_key, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded, True)
    views = {(key, tuple(it.global_offset)): it.data for key, items in by_key.items()
             for it in items if isinstance(it, ShardedTensor)}
    pyt = mcore_to_pyt_state_dict(by_key, False)

    def key_of(item) -> tuple:
        return item.index.fqn, tuple(item.index.offset)

    def make(item) -> torch.Tensor:
        return source.resolve(views[key_of(item)]).reshape(item.tensor_data.chunk.sizes)

    class LazyPlanner(MCoreSavePlanner):
        prefetcher: Optional[_Prefetcher] = None
        prefetch_bytes = prefetch_budget

        def start_prefetch(self, items) -> _Prefetcher:
            tensor_items = [it for it in items if it.type != WriteItemType.BYTE_IO]
            by_key = {key_of(it): it for it in tensor_items}
            self.prefetcher = _Prefetcher([key_of(it) for it in tensor_items], lambda k: make(by_key[k]),
                                          prefetch_budget)
            return self.prefetcher

        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            t = self.prefetcher.get(key_of(write_item)) if self.prefetcher else make(write_item)
            on_item(t.numel() * t.element_size())
            return t

    from torch.utils.serialization import config as ser_config

    out.mkdir(parents=True, exist_ok=True)
    writer = source_order_writer(out, workers, lambda item: source.position(views[key_of(item)]))
    planner = LazyPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    crc = ser_config.save.compute_crc32
    ser_config.save.compute_crc32 = False  # torch.load never verifies it; it costs ~10% of the write
    try:
        dcp.save(pyt, storage_writer=writer, planner=planner)
    finally:
        ser_config.save.compute_crc32 = crc
        if planner.prefetcher is not None:
            planner.prefetcher.close()
    save_config(CheckpointingConfig("torch_dist", 1), str(out))


def reraise_nonfinite(e: BaseException) -> None:
    """DCP wraps a writer thread's error in a ``CheckpointException``: surface our own."""
    seen, stack = set(), [e]
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, NonFiniteError):
            raise NonFiniteError(str(x)) from None
        if isinstance(x, tuple):  # DCP's (exception, traceback) pairs
            stack += [v for v in x if isinstance(v, BaseException)]
            continue
        stack += [x.__cause__, x.__context__, *getattr(x, "failures", {}).values()]

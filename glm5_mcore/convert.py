"""``glm5 convert``: HF safetensors ↔ the Megatron-Core checkpoint layout (``glm5_mcore.checkpoint``).

Both directions stream. The Megatron side is described by a GLM-5 ``GPTModel`` built on the meta
device at TP1/EP1 (no memory): its ``sharded_state_dict()`` is exactly what Megatron-Core's own save
would write, and Megatron-Core's own loader reshards it into any TP/EP/PP.

- hf-to-mcore: Megatron's save pipeline (factories, sharded keys, PyTorch-DCP translation) runs on
  the meta model, and a save planner fills each write item only when the writer reaches it, from the
  HF tensor(s) the one name table (``hf_names``) points at. Peak memory is the items in flight (one
  per ``--workers`` thread), not the model.
- mcore-to-hf: one decoder/MTP layer at a time is materialised, loaded with Megatron-Core's loader
  and appended to the current output shard; shards are written as they fill.

Every check that can fail (missing / unmapped / mis-shaped / mis-typed tensors, corrupt files) runs
before anything is written; the output folder is built under a temporary name and renamed only when
complete, so a previous good output survives any failure.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Callable, Optional

import torch

from glm5_mcore.atomic import atomic_dir, publish_file
from glm5_mcore.checkpoint import HF_META_FILES, iter_dir, write_hf_meta
from glm5_mcore.config import GLM5Config, ParallelConfig
from glm5_mcore.hf_io import FP8, HFCheckpoint, PlannedSafetensorsWriter
from glm5_mcore.hf_names import FP32_HF_SUFFIXES, hf_source

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
_HF_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}
_FLOAT = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class _Progress:
    """tqdm over bytes with a tensor count; thread-safe; silent when ``enabled`` is False."""

    def __init__(self, total_bytes: int, n_tensors: int, desc: str, enabled: bool = True):
        from tqdm import tqdm

        self.bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=desc, disable=not enabled,
                        dynamic_ncols=True)
        self.n, self.total, self.lock = 0, n_tensors, threading.Lock()

    def update(self, nbytes: int) -> None:
        with self.lock:
            self.n += 1
            self.bar.update(nbytes)
            self.bar.set_postfix_str(f"{self.n}/{self.total} tensors", refresh=False)

    def close(self) -> None:
        self.bar.close()


def meta_model(glm5: GLM5Config, dtype: torch.dtype):
    """The TP1/EP1 GLM-5 ``GPTModel`` on the meta device (shapes, names and sharding only)."""
    import megatron.core.models.gpt.gpt_model  # noqa: F401
    import megatron.core.transformer.experimental_attention_variant.dsa  # noqa: F401
    import megatron.core.transformer.moe.moe_utils  # noqa: F401
    import megatron.core.transformer.multi_token_prediction  # noqa: F401

    import glm5_mcore.layer_spec  # noqa: F401
    from glm5_mcore.model import build_model, init_parallel

    # Everything is imported above: a module imported inside the meta context would create its
    # module-level tensors (e.g. MTPLossAutoScaler.main_loss_backward_scale) on the meta device.
    init_parallel(ParallelConfig())
    with torch.device("meta"):
        return build_model(glm5, ParallelConfig(), params_dtype=dtype, use_cpu_initialization=True,
                           perform_initialization=False)


def _named_tensors(model) -> dict[str, torch.Tensor]:
    return {n: t for n, t in model.state_dict(keep_vars=True).items()
            if torch.is_tensor(t) and not n.endswith("_extra_state")}


# --------------------------------------------------------------------------------------------------
# HF -> Megatron
# --------------------------------------------------------------------------------------------------
class _HFSourcePlan:
    """For every Megatron tensor of the meta model: its HF parts, checked against the files."""

    def __init__(self, model, glm5: GLM5Config, ckpt: HFCheckpoint):
        self.ckpt = ckpt
        self.tensors = _named_tensors(model)
        self.by_id = {id(t): n for n, t in self.tensors.items()}
        self.sources = {}
        needed_stored: set[str] = set()
        self.total_bytes = 0
        for name, t in self.tensors.items():
            src = hf_source(name, glm5.num_hidden_layers)
            expect = (t.shape[0] // 2, *t.shape[1:]) if src.is_glu else tuple(t.shape)
            for h in src.names:
                if h not in ckpt:
                    raise ValueError(f"{ckpt.dir}: tensor {h} is missing (Megatron {name} needs it; "
                                     f"config.json and the weights disagree?)")
                path, dtype, shape, nbytes = ckpt.info(h)
                if tuple(shape) != tuple(expect):
                    raise ValueError(f"{path}: tensor {h} has shape {list(shape)}, the config implies "
                                     f"{list(expect)}")
                if dtype not in _FLOAT and dtype not in FP8:
                    raise ValueError(f"{path}: tensor {h} has dtype {dtype}, expected a float type")
                needed_stored.update(ckpt.stored_names_for(h))
                self.total_bytes += nbytes
            self.sources[name] = src
        unmapped = [k for k in ckpt.keys() if k not in needed_stored]
        if unmapped:
            listed = ", ".join(f"{k} ({ckpt.files[k].name})" for k in unmapped[:5])
            raise ValueError(f"{ckpt.dir}: {len(unmapped)} tensor(s) the GLM-5 name table does not map "
                             f"for this config: {listed}")

    def resolve(self, view: torch.Tensor) -> torch.Tensor:
        """The real data of ``view``, a meta param or a (factory) view of one."""
        base = view._base if view._base is not None else view
        name = self.by_id[id(base)]
        src = self.sources[name]
        names = src.names
        offset = view.storage_offset() - base.storage_offset()
        if src.is_glu:  # read only the half the view lies in
            half = base.numel() // 2
            if offset >= half:
                names, offset = names[1:], offset - half
            elif offset + view.numel() <= half and view.is_contiguous():
                names = names[:1]
        parts = [self.ckpt.get(h).to(base.dtype) for h in names]
        full = (parts[0] if len(parts) == 1 else torch.cat(parts, 0)).contiguous()
        return full.as_strided(view.size(), view.stride(), full.storage_offset() + offset).contiguous()


def _lazy_dcp_save(model, out: Path, resolve: Callable[[torch.Tensor], torch.Tensor], workers: int,
                   on_item: Callable[[int], None]) -> None:
    """Megatron-Core's torch_dist save of ``model.sharded_state_dict()`` with data made on demand."""
    import torch.distributed.checkpoint as dcp
    from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.state_dict_utils import save_preprocess
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, _replace_state_dict_keys_with_sharded_keys, mcore_to_pyt_state_dict)
    from torch.distributed.checkpoint.planner import WriteItemType

    sharded, common = save_preprocess(model.sharded_state_dict(), validate_access_integrity=False)
    sharded["common_state"] = ShardedObject("common_state", common, (1,), (0,), replica_id=0)
    by_key, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded, True)
    views = {(key, tuple(it.global_offset)): it.data for key, items in by_key.items()
             for it in items if isinstance(it, ShardedTensor)}
    pyt = mcore_to_pyt_state_dict(by_key, False)

    class LazyPlanner(MCoreSavePlanner):
        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            view = views[(write_item.index.fqn, tuple(write_item.index.offset))]
            t = resolve(view).reshape(write_item.tensor_data.chunk.sizes)
            on_item(t.numel() * t.element_size())
            return t

    from torch.utils.serialization import config as ser_config

    out.mkdir(parents=True, exist_ok=True)
    writer = dcp.FileSystemWriter(str(out), single_file_per_rank=True, thread_count=max(1, workers),
                                  sync_files=False)
    crc = ser_config.save.compute_crc32
    ser_config.save.compute_crc32 = False  # torch.load never verifies it; it costs ~10% of the write
    try:
        dcp.save(pyt, storage_writer=writer,
                 planner=LazyPlanner(flatten_state_dict=False, flatten_sharded_tensors=False))
    finally:
        ser_config.save.compute_crc32 = crc
    save_config(CheckpointingConfig("torch_dist", 1), str(out))


def hf_to_mcore(hf_dir: str | Path, out: str | Path, workers: int = 1, dtype: Optional[str] = None,
                progress: bool = True) -> Path:
    """Convert an HF GLM-5 folder into ``out`` (``iter_0000000/model``, ``hf/``, ``latest``)."""
    hf_dir = Path(hf_dir)
    glm5 = GLM5Config.from_hf_dir(hf_dir)
    ckpt = HFCheckpoint(hf_dir)
    if dtype is None:
        td = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}.get(
            glm5.torch_dtype, torch.bfloat16)
    elif dtype in DTYPES:
        td = DTYPES[dtype]
    else:
        raise ValueError(f"--dtype {dtype}: expected one of {sorted(DTYPES)}")
    model = meta_model(glm5, td)
    plan = _HFSourcePlan(model, glm5, ckpt)
    bar = _Progress(plan.total_bytes, sum(len(s.names) for s in plan.sources.values()), "hf-to-mcore", progress)
    try:
        with atomic_dir(out) as tmp:
            _lazy_dcp_save(model, iter_dir(tmp, 0) / "model", plan.resolve, workers, bar.update)
            config = json.loads((hf_dir / "config.json").read_text())
            config.pop("quantization_config", None)
            config["dtype"] = _HF_DTYPE_NAMES[td]
            config.pop("torch_dtype", None)
            write_hf_meta(tmp / "hf", hf_dir, config)
            (iter_dir(tmp, 0) / "trainer_state.json").write_text(json.dumps({"iteration": 0}, indent=2))
            (tmp / "latest").write_text("0\n")
    finally:
        bar.close()
    return Path(out)


# --------------------------------------------------------------------------------------------------
# Megatron -> HF
# --------------------------------------------------------------------------------------------------
def _parse_size(s: str | int) -> int:
    if isinstance(s, int):
        return s
    units = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    t = s.strip().upper()
    for u in sorted(units, key=len, reverse=True):
        if t.endswith(u):
            try:
                return int(float(t[: -len(u)]) * units[u])
            except ValueError:
                break
    if t.isdigit():
        return int(t)
    raise ValueError(f"--max-shard-size {s!r}: expected e.g. 5GB, 500MB or a byte count")


def _checkpoint_dtype(model_path: Path) -> torch.dtype:
    from torch.distributed.checkpoint import FileSystemReader

    try:
        md = FileSystemReader(str(model_path)).read_metadata()
    except Exception as e:
        raise ValueError(f"{model_path}: unreadable distributed-checkpoint metadata ({e})") from None
    for key, m in md.state_dict_metadata.items():
        if key.endswith("word_embeddings.weight"):
            return m.properties.dtype
    raise ValueError(f"{model_path}: no embedding tensor in the checkpoint")


def _release_freed_memory() -> None:
    """Hand freed heap pages back to the OS after each layer (glibc keeps them in its arenas, so
    RSS would grow to the largest layers seen, not stay at one layer)."""
    import ctypes
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _layer_groups(model) -> list[str]:
    groups = ["embedding"]
    groups += [f"decoder.layers.{i}" for i in range(len(model.decoder.layers))]
    groups += ["decoder.final_layernorm", "output_layer"]
    if getattr(model, "mtp", None) is not None:
        groups += [f"mtp.layers.{m}" for m in range(len(model.mtp.layers))]
    return groups


@torch.no_grad()
def mcore_to_hf(ckpt: str | Path, out: str | Path, max_shard_size: str | int = "5GB",
                iteration: Optional[int] = None, progress: bool = True, merge_adapter=None) -> Path:
    """Write an HF GLM-5 folder (on-disk per-expert layout, MTP layer included) from a checkpoint.

    ``merge_adapter`` (an ``AdapterState``): its ``scale·B·A`` is added to each Megatron weight
    before the weight is split into HF tensors (gate/up halves, per-expert names)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    from glm5_mcore.checkpoint import model_dir

    root = Path(ckpt)
    model_path = model_dir(root, iteration)
    if not (model_path / "metadata.json").is_file():
        raise FileNotFoundError(f"{model_path}: not a Megatron-Core distributed checkpoint (no metadata.json)")
    if not (root / "hf" / "config.json").is_file():
        raise FileNotFoundError(f"{root / 'hf' / 'config.json'}: missing; the checkpoint has no HF config")
    glm5 = GLM5Config.from_hf_dir(root / "hf")
    td = _checkpoint_dtype(model_path)
    max_bytes = _parse_size(max_shard_size)
    model = meta_model(glm5, td)
    groups = _layer_groups(model)
    tensors = _named_tensors(model)
    plan = []
    for name, t in tensors.items():
        src = hf_source(name, glm5.num_hidden_layers)
        shape = (t.shape[0] // 2, *t.shape[1:]) if src.is_glu else tuple(t.shape)
        for h in src.names:
            plan.append((h, torch.float32 if h.endswith(FP32_HF_SUFFIXES) else td, shape))
    bar = _Progress(sum(t.numel() * t.element_size() for t in tensors.values()), len(plan), "mcore-to-hf",
                    progress)
    try:
        with atomic_dir(out) as tmp:
            writer = PlannedSafetensorsWriter(tmp, plan, max_bytes)
            merged: set[str] = set()
            for group in groups:
                module = model.get_submodule(group)
                module.to_empty(device="cpu")
                sharded = {k: v for k, v in model.sharded_state_dict().items()
                           if k.startswith(group + ".")}
                try:
                    loaded = dist_checkpointing.load(sharded, str(model_path),
                                                     strict=StrictHandling.ASSUME_OK_UNEXPECTED)
                except (Exception, CheckpointException) as e:
                    raise ValueError(f"{model_path}: could not load {group} "
                                     f"({type(e).__name__}: {str(e)[:500]})") from None
                for name, t in loaded.items():
                    if name.endswith("_extra_state") or not torch.is_tensor(t):
                        continue
                    src = hf_source(name, glm5.num_hidden_layers)
                    target = name[: -len(".weight")] if name.endswith(".weight") else None
                    if merge_adapter is not None and target in merge_adapter.A:
                        t = (t.float() + merge_adapter.delta(target)).to(t.dtype)
                        merged.add(target)
                    parts = t.chunk(2, dim=0) if src.is_glu else (t,)
                    for h, part in zip(src.names, parts):
                        writer.write(h, part.to(torch.float32 if h.endswith(FP32_HF_SUFFIXES) else td))
                        bar.update(part.numel() * part.element_size())
                del loaded, sharded
                module.to_empty(device="meta")
                _release_freed_memory()
            writer.finish()
            if merge_adapter is not None and set(merge_adapter.A) - merged:
                left = sorted(set(merge_adapter.A) - merged)
                raise ValueError(f"adapter modules {left[:3]} have no weight in {model_path}")
            for f in tmp.glob("*.safetensors"):
                publish_file(f)
            config = json.loads((root / "hf" / "config.json").read_text())
            config.pop("quantization_config", None)
            config.pop("torch_dtype", None)
            config["dtype"] = _HF_DTYPE_NAMES.get(td, "bfloat16")
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            for name in HF_META_FILES:
                if name != "config.json" and (root / "hf" / name).is_file():
                    (tmp / name).write_bytes((root / "hf" / name).read_bytes())
    finally:
        bar.close()
    return Path(out)

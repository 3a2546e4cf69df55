"""``glm5 convert``: HF safetensors ↔ the Megatron-Core checkpoint layout (``glm5_mcore.checkpoint.layout``).

Both directions stream. The Megatron side is described by a GLM-5 ``GPTModel`` built on the meta
device at TP1/EP1 (no memory): its ``sharded_state_dict()`` is exactly what Megatron-Core's own save
would write, and Megatron-Core's own loader reshards it into any TP/EP/PP.

- hf-to-mcore: Megatron's save pipeline (factories, sharded keys, PyTorch-DCP translation) runs on
  the meta model, and a save planner fills each write item only when the writer reaches it, from the
  HF tensor(s) the one name table (``hf_names``) points at. Items are written in the order their HF
  bytes lie (the shards are read front to back, a thread ahead of the writer) and each layer's
  items end up together (``dcp_write``). Peak memory is the items in flight, not the model.
- mcore-to-hf: one decoder/MTP layer at a time is materialised, loaded (Megatron-Core's key
  translation and planner; chunks read in large runs straight into the parameters, ``dcp_read``)
  while the previous layer is appended to the output shards, which stream front to back. A layer
  bigger than a quarter of an output shard is loaded in slices of its experts (``layer_slices``), so peak
  memory stays near one output shard whatever the layer size.

Both write past the page cache (``direct_io``): the bytes are written once and never read back.

Every check that can fail (missing / unmapped / mis-shaped / mis-typed tensors, corrupt files) runs
before anything is written; the output folder is built under a temporary name and renamed only when
complete, so a previous good output survives any failure. ``--out`` is guarded (``atomic.output_dir``:
never an input, never a folder of something else); inputs are verified against their checksum
manifests, the output gets one; a NaN/Inf weight is an error naming the tensor (``allow_nonfinite``).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from pathlib import Path
from typing import Optional

import torch

from glm5_mcore.checkpoint.atomic import check_output, output_dir, publish_file
from glm5_mcore.checkpoint.layout import HF_META_FILES, iter_dir, write_hf_meta
from glm5_mcore.checkpoint.checks import check_finite
from glm5_mcore.config import GLM5Config, ParallelConfig
from glm5_mcore.convert.dcp_pieces import load_pieces
from glm5_mcore.convert.dcp_read import DirectReader, load_sharded
from glm5_mcore.convert.dcp_write import lazy_dcp_save, reraise_nonfinite
from glm5_mcore.checkpoint.direct_io import bulk_io
from glm5_mcore.convert.out_dtypes import DTYPES, HF_DTYPE_NAMES, OutputDtypes
from glm5_mcore.checkpoint.hf_io import FP8, HFCheckpoint, PlannedSafetensorsWriter
from glm5_mcore.checkpoint.hf_names import hf_source
from glm5_mcore.convert.layer_slices import slice_units

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

    import glm5_mcore.model.layer_spec  # noqa: F401
    from glm5_mcore.model.build import build_model
    from glm5_mcore.model.parallel import init_parallel

    # Everything is imported above: a module imported inside the meta context would create its
    # module-level tensors (e.g. MTPLossAutoScaler.main_loss_backward_scale) on the meta device.
    init_parallel(ParallelConfig())
    with torch.device("meta"):
        return build_model(glm5, ParallelConfig(), params_dtype=dtype, use_cpu_initialization=True,
                           perform_initialization=False, device="meta")


def _named_tensors(model) -> dict[str, torch.Tensor]:
    return {n: t for n, t in model.state_dict(keep_vars=True).items()
            if torch.is_tensor(t) and not n.endswith("_extra_state")}


# --------------------------------------------------------------------------------------------------
# HF -> Megatron
# --------------------------------------------------------------------------------------------------
class _HFSourcePlan:
    """For every Megatron tensor of the meta model: its HF parts, checked against the files."""

    def __init__(self, model, glm5: GLM5Config, ckpt: HFCheckpoint, allow_nonfinite: bool = False):
        self.ckpt, self.allow_nonfinite = ckpt, allow_nonfinite
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

    def position(self, view: torch.Tensor) -> tuple[str, int]:
        """Where the first HF bytes ``view`` is made from lie: (file, byte offset)."""
        base = view._base if view._base is not None else view
        stored, expert, _ = self.ckpt.locate(self.sources[self.by_id[id(base)]].names[0])
        path = self.ckpt.files[stored]
        _, shape, start, end = self.ckpt._file(path).tensors[stored]
        return str(path), start + (expert or 0) * ((end - start) // max(1, shape[0]))

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
        if not self.allow_nonfinite:
            for h, part in zip(names, parts):
                check_finite(part, h, self.ckpt.files[self.ckpt.locate(h)[0]])
        full = (parts[0] if len(parts) == 1 else torch.cat(parts, 0)).contiguous()
        return full.as_strided(view.size(), view.stride(), full.storage_offset() + offset).contiguous()


def hf_to_mcore(hf_dir: str | Path, out: str | Path, workers: int = 1, dtype: Optional[str] = None,
                progress: bool = True, overwrite: bool = False, allow_nonfinite: bool = False) -> Path:
    """Convert an HF GLM-5 folder into ``out`` (``iter_0000000/model``, ``hf/``, ``latest``)."""
    from glm5_mcore.checkpoint.manifest import verify_under, write_manifest
    from glm5_mcore.checkpoint.folder_config import hf_dir_config

    hf_dir = Path(hf_dir)
    check_output(out, "convert hf-to-mcore", [hf_dir], overwrite)
    verify_under(hf_dir)  # an HF folder we wrote (mcore-to-hf) carries a manifest
    glm5 = hf_dir_config(hf_dir)  # MTP layers the weights lack are left out (a notice)
    ckpt = HFCheckpoint(hf_dir)
    if dtype is None:
        td = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}.get(
            glm5.torch_dtype, torch.bfloat16)
    elif dtype in DTYPES:
        td = DTYPES[dtype]
    else:
        raise ValueError(f"--dtype {dtype}: expected one of {sorted(DTYPES)}")
    model = meta_model(glm5, td)
    plan = _HFSourcePlan(model, glm5, ckpt, allow_nonfinite)
    bar = _Progress(plan.total_bytes, sum(len(s.names) for s in plan.sources.values()), "hf-to-mcore", progress)
    try:
        with output_dir(out, "convert hf-to-mcore", [hf_dir], overwrite, manifest=False) as tmp, bulk_io():
            try:
                lazy_dcp_save(model, iter_dir(tmp, 0) / "model", plan, workers, bar.update)
            except BaseException as e:
                reraise_nonfinite(e)
                raise
            config = json.loads((hf_dir / "config.json").read_text())
            config.pop("quantization_config", None)
            config["dtype"] = HF_DTYPE_NAMES[td]
            config.pop("torch_dtype", None)
            write_hf_meta(tmp / "hf", hf_dir, config)
            (iter_dir(tmp, 0) / "trainer_state.json").write_text(json.dumps({"iteration": 0}, indent=2))
            write_manifest(iter_dir(tmp, 0))
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


class _GroupLoader:
    """Loads a checkpoint one unit (a list of tensor names: a layer, or a slice of a big layer's
    experts, ``layer_slices``) at a time with Megatron-Core's key translation and planner
    (``dcp_read`` reads), the next unit on a background thread while the caller writes the current
    one (two units in memory at most).

    The model's sharded state dict is taken once on the meta device; a unit's tensors are
    materialised into a slab kept across units and its entries pointed at them. GLU factories are
    built before loading, so a fused ``linear_fc1`` comes back as its gate and up halves (views of
    the parameter) instead of Megatron's merged copy (``torch.cat``) that the HF side would split
    again."""

    def __init__(self, model, model_path: Path):
        from concurrent.futures import ThreadPoolExecutor

        self.model, self.path = model, model_path
        self.reader = DirectReader(model_path)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="glm5-convert-load")
        self.slabs: list[Optional[torch.Tensor]] = [None, None]
        self.sharded = model.sharded_state_dict()

    def _slot(self, name: str) -> tuple[torch.nn.Module, str, torch.Tensor]:
        path, attr = name.rsplit(".", 1)
        mod = self.model.get_submodule(path)
        t = mod._parameters.get(attr) if attr in mod._parameters else mod._buffers.get(attr)
        if t is None:
            raise RuntimeError(f"{name}: not a parameter or buffer of the model")
        return mod, attr, t

    def _set(self, mod: torch.nn.Module, attr: str, t: torch.Tensor) -> None:
        if attr in mod._parameters:
            mod._parameters[attr] = torch.nn.Parameter(t, requires_grad=False)
        else:
            mod._buffers[attr] = t

    def _materialize(self, names: list[str], slot: int) -> dict[str, torch.Tensor]:
        """The unit's tensors as views of a slab kept across units: a fresh allocation per unit
        would be page-faulted in again (a third of the load time on a VM)."""
        slots = [self._slot(n) for n in names]
        sizes = [-(-t.numel() * t.element_size() // 64) * 64 for _, _, t in slots]
        if self.slabs[slot] is None or self.slabs[slot].numel() < sum(sizes):
            self.slabs[slot] = None
            self.slabs[slot] = torch.empty(sum(sizes), dtype=torch.uint8)
        slab, offset, views = self.slabs[slot], 0, {}
        for name, (mod, attr, t), n in zip(names, slots, sizes):
            view = slab[offset: offset + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            offset += n
            self._set(mod, attr, view)
            views[name] = self._slot(name)[2]
        return views

    def _release(self, names: list[str]) -> None:
        for name in names:
            mod, attr, t = self._slot(name)
            self._set(mod, attr, torch.empty(t.shape, dtype=t.dtype, device="meta"))

    def _prepare(self, names: list[str], slot: int) -> tuple[dict, dict]:
        import copy

        from megatron.core.dist_checkpointing.mapping import apply_factories

        views = self._materialize(names, slot)
        sharded = {}
        for name in names:
            if name not in self.sharded:
                raise RuntimeError(f"{name}: not in the model's sharded state dict")
            entry = copy.copy(self.sharded[name])
            entry.data = views[name]
            sharded[name] = entry
        apply_factories(sharded)
        return sharded, views

    def _load(self, label: str, prepared: tuple) -> dict:
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        sharded, views = prepared
        try:
            if label.endswith("]"):  # a slice of a layer: some fragments of its expert keys
                load_pieces(sharded, self.reader, str(self.path))
                return views
            return load_sharded(sharded, self.reader)
        except (Exception, CheckpointException) as e:
            from glm5_mcore.checkpoint.checks import short_error

            raise ValueError(f"{self.path}: could not load {label} ({short_error(e)})") from None

    def stream(self, units: list[tuple[str, list[str]]], ahead: bool = True):
        """Yield (names, loaded state dict) per unit in order; a unit's memory is released after the
        next yield. ``ahead=False`` loads a unit only after the previous one is released (one unit
        in memory)."""
        future = self.pool.submit(self._load, units[0][0], self._prepare(units[0][1], 0))
        for i, (label, names) in enumerate(units):
            loaded = future.result()
            if ahead and i + 1 < len(units):
                future = self.pool.submit(self._load, units[i + 1][0], self._prepare(units[i + 1][1], (i + 1) % 2))
            yield names, loaded
            del loaded
            self._release(names)
            if not ahead and i + 1 < len(units):
                future = self.pool.submit(self._load, units[i + 1][0], self._prepare(units[i + 1][1], 0))

    def __enter__(self) -> "_GroupLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.reader.close()


def _layer_groups(model) -> list[str]:
    groups = ["embedding"]
    groups += [f"decoder.layers.{i}" for i in range(len(model.decoder.layers))]
    groups += ["decoder.final_layernorm", "output_layer"]
    if getattr(model, "mtp", None) is not None:
        groups += [f"mtp.layers.{m}" for m in range(len(model.mtp.layers))]
    return groups


@torch.no_grad()
def mcore_to_hf(ckpt: str | Path, out: str | Path, max_shard_size: str | int = "5GB",
                iteration: Optional[int] = None, progress: bool = True, merge_adapter=None,
                overwrite: bool = False, kind: str = "convert mcore-to-hf", allow_nonfinite: bool = False,
                dtype: Optional[str] = None) -> Path:
    """Write an HF GLM-5 folder (on-disk per-expert layout, the MTP layers the checkpoint holds) from a checkpoint.

    Each tensor is written in the dtype its HF origin stored it in (``hf/dtypes.json``); without
    a record, in ``config.json``'s dtype. ``dtype`` overrides: "bf16"/"fp16"/"fp32" (the router stays
    fp32), or "fp8": the release's FP8 block format (``glm5_mcore.checkpoint.fp8``), the rest in bf16.
    ``merge_adapter`` (an ``AdapterState``): its ``scale·B·A`` is added to each Megatron weight
    before the weight is split into HF tensors (gate/up halves, per-expert names)."""
    from glm5_mcore.checkpoint.layout import model_dir
    from glm5_mcore.checkpoint.manifest import Background
    from glm5_mcore.checkpoint.folder_config import checkpoint_config

    root = Path(ckpt)
    check_output(out, kind, [root], overwrite)
    model_path = model_dir(root, iteration)
    if not (model_path / "metadata.json").is_file():
        raise FileNotFoundError(f"{model_path}: not a Megatron-Core distributed checkpoint (no metadata.json)")
    from glm5_mcore.checkpoint import megatron_lm as foreign_ckpt

    if foreign_ckpt.is_foreign(root):  # Megatron-LM / Bridge: config from the checkpoint's own
        glm5, hf_config, meta_dir = foreign_ckpt.hf_side(root, iteration)
        hf_config = {k: v for k, v in hf_config.items() if k not in ("dtype", "torch_dtype")}  # the checkpoint's
    else:
        if not (root / "hf" / "config.json").is_file():
            raise FileNotFoundError(f"{root / 'hf' / 'config.json'}: missing; the checkpoint has no HF config")
        glm5, meta_dir = checkpoint_config(root, iteration), root / "hf"  # MTP as stored (a notice)
        hf_config = json.loads((root / "hf" / "config.json").read_text())
    td = _checkpoint_dtype(model_path)
    out_dtype = OutputDtypes(meta_dir, hf_config, td, dtype)
    max_bytes = _parse_size(max_shard_size)
    model = meta_model(glm5, td)
    tensors = _named_tensors(model)
    groups = {g: [n for n in tensors if n.startswith(g + ".")] for g in _layer_groups(model)}
    outside = set(tensors) - {n for names in groups.values() for n in names}
    if outside:
        raise RuntimeError(f"model tensors outside every layer group: {sorted(outside)[:3]}")
    plan = []  # in the order the groups are loaded and written: the output files stream front to back
    for names in groups.values():
        for name in names:
            t = tensors[name]
            src = hf_source(name, glm5.num_hidden_layers)
            shape = (t.shape[0] // 2, *t.shape[1:]) if src.is_glu else tuple(t.shape)
            for h in src.names:
                plan.extend(out_dtype.plan(h, shape))
    bar = _Progress(sum(t.numel() * t.element_size() for t in tensors.values()), len(plan), "mcore-to-hf",
                    progress)
    checks = Background(model_path)  # checksums verified alongside the conversion, before publishing
    try:
        with output_dir(out, kind, [root], overwrite) as tmp, contextlib.ExitStack() as stack, bulk_io():
            writer = PlannedSafetensorsWriter(tmp, plan, max_bytes)
            stack.callback(writer.close)
            merged: set[str] = set()
            loader = stack.enter_context(_GroupLoader(model, model_path))
            # Units of at most a quarter of an output shard (a full-size GLM-5 MoE layer, ~19 GB, is
            # cut into slices of its experts): the next loads while this one is written, and the two
            # in memory stay within half a shard; the process itself (torch, Megatron-Core, the meta
            # model) takes about 1 GB more.
            nbytes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
            units = slice_units(groups, nbytes, max(1, max_bytes // 4))
            largest = max(sum(nbytes[n] for n in names) for _, names in units)
            for names, loaded in loader.stream(units, ahead=2 * largest <= max_bytes):
                for name in names:
                    t = loaded[name]
                    src = hf_source(name, glm5.num_hidden_layers)
                    target = name[: -len(".weight")] if name.endswith(".weight") else None
                    if isinstance(t, (list, tuple)) and (len(t) != len(src.names) or (
                            merge_adapter is not None and target in merge_adapter.A)):
                        t = torch.cat(list(t), 0)
                    if merge_adapter is not None and target in merge_adapter.A:
                        t = (t.float() + merge_adapter.delta(target)).to(t.dtype)
                        merged.add(target)
                    if isinstance(t, (list, tuple)):  # a GLU weight's gate and up halves, as loaded
                        parts = t
                    else:
                        parts = t.chunk(2, dim=0) if src.is_glu else (t,)
                    for h, part in zip(src.names, parts):
                        if not allow_nonfinite:
                            check_finite(part, f"{h} (Megatron {name})", model_path)
                        for name_out, t_out in out_dtype.tensors(h, part):
                            writer.write(name_out, t_out)
                        bar.update(part.numel() * part.element_size())
            writer.finish()
            if merge_adapter is not None and set(merge_adapter.A) - merged:
                left = sorted(set(merge_adapter.A) - merged)
                raise ValueError(f"adapter modules {left[:3]} have no weight in {model_path}")
            for f in tmp.glob("*.safetensors"):
                publish_file(f)
            config = dict(hf_config)
            config.pop("quantization_config", None)
            config.pop("torch_dtype", None)
            config["dtype"] = out_dtype.config_dtype(plan)
            if out_dtype.fp8_written:
                from glm5_mcore.checkpoint.fp8 import QUANTIZATION_CONFIG

                config["quantization_config"] = dict(QUANTIZATION_CONFIG)
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            for name in HF_META_FILES:
                if name != "config.json" and meta_dir is not None and (meta_dir / name).is_file():
                    (tmp / name).write_bytes((meta_dir / name).read_bytes())
            checks.result()
    except BaseException:
        checks.result()  # a corrupt file explains a failure better than what it caused
        raise
    finally:
        bar.close()
    return Path(out)

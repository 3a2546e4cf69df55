"""``glm5 convert mcore-to-hf``: a Megatron-Core checkpoint (ours, or a Megatron-LM / Bridge folder) as an HF
folder, one decoder/MTP layer at a time (the design: ``glm5_mcore.convert.hf_to_mcore``'s docstring)."""

from __future__ import annotations

import contextlib
import math
from concurrent.futures import ThreadPoolExecutor
import json
from pathlib import Path
from typing import Optional

import torch

from glm5_mcore.checkpoint.atomic import check_output, output_dir, publish_file
from glm5_mcore.checkpoint.layout import HF_META_FILES
from glm5_mcore.checkpoint.checks import check_finite, check_finite_fp8, short_error
from glm5_mcore.checkpoint.fp8 import QUANTIZATION_CONFIG, scale_shape
from glm5_mcore.checkpoint.fp8_sharded import SCALE_SUFFIX, fp8_pair
from glm5_mcore.checkpoint.dcp_pieces import load_pieces
from glm5_mcore.convert.dcp_read import DirectReader, load_sharded
from glm5_mcore.checkpoint.direct_io import bulk_io
from glm5_mcore.convert.out_dtypes import OutputDtypes
from glm5_mcore.checkpoint.hf_io import PlannedSafetensorsWriter
from glm5_mcore.checkpoint.hf_names import hf_source
from glm5_mcore.convert.layer_slices import slice_units

from glm5_mcore.checkpoint import megatron_lm
from glm5_mcore.checkpoint.folder_config import checkpoint_config
from glm5_mcore.checkpoint.layout import model_dir
from glm5_mcore.checkpoint.manifest import StreamVerifier
from glm5_mcore.convert.common import Progress, checkpoint_dtype, meta_model, named_tensors, verified_run
from glm5_mcore.convert.fp8_stored import merged_weight, stored_fp8_names, stored_nbytes, stored_parts

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


class GroupLoader:
    """Loads a checkpoint one unit (a list of tensor names: a layer, or a slice of a big layer's
    experts, ``layer_slices``) at a time with Megatron-Core's key translation and planner
    (``dcp_read`` reads), the next unit on a background thread while the caller writes the current
    one (two units in memory at most).

    The model's sharded state dict is taken once on the meta device; a unit's tensors are
    materialised into a slab kept across units and its entries pointed at them. GLU factories are
    built before loading, so a fused ``linear_fc1`` comes back as its gate and up halves (views of
    the parameter) instead of Megatron's merged copy (``torch.cat``) that the HF side would split
    again."""

    def __init__(self, model, model_path: Path, verifier=None, sharded: Optional[dict] = None,
                 fp8: Optional[dict[str, int]] = None):
        self.model, self.path = model, model_path
        self.reader = DirectReader(model_path, verifier)
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="glm5-convert-load")
        self.slabs: list[Optional[torch.Tensor]] = [None, None]
        self.sharded = model.sharded_state_dict() if sharded is None else sharded
        self.fp8 = fp8 or {}
        """{name: block} of the weights the checkpoint stores in FP8 (``convert.fp8_stored.stored_fp8_names``)."""

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
        would be page-faulted in again (a third of the load time on a VM). A weight stored in FP8 gets
        its e4m3 data (``name``) and scales (``name_scale_inv``) there instead, as stored."""
        pieces = []  # (key, dtype, shape, parameter slot or None)
        for name in names:
            mod, attr, t = self._slot(name)
            if name in self.fp8:
                pieces += [(name, torch.float8_e4m3fn, tuple(t.shape), None),
                           (name + SCALE_SUFFIX, torch.float32, scale_shape(tuple(t.shape), self.fp8[name]), None)]
            else:
                pieces.append((name, t.dtype, tuple(t.shape), (mod, attr)))
        nbytes = [math.prod(shape) * dtype.itemsize for _, dtype, shape, _ in pieces]
        total = sum(-(-n // 64) * 64 for n in nbytes)
        if self.slabs[slot] is None or self.slabs[slot].numel() < total:
            self.slabs[slot] = None
            self.slabs[slot] = torch.empty(total, dtype=torch.uint8)
        slab, offset, views = self.slabs[slot], 0, {}
        for (key, dtype, shape, where), n in zip(pieces, nbytes):
            view = slab[offset: offset + n].view(dtype).view(shape)
            offset += -(-n // 64) * 64
            if where is None:
                views[key] = view
            else:
                self._set(*where, view)
                views[key] = self._slot(key)[2]
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
            if name in self.fp8:  # the stored (e4m3, scales) pair, read as it is
                sharded[name], sharded[name + SCALE_SUFFIX] = fp8_pair(
                    self.sharded[name], views[name], views[name + SCALE_SUFFIX], self.fp8[name], f"{self.path}: {name}")
                continue
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

    def __enter__(self) -> "GroupLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.reader.close()


def _write_stored(writer, out_dtype, hf_names, pairs, block: int, name: str, model_path: Path, allow_nonfinite: bool,
                  bar) -> None:
    """A weight the checkpoint stores in FP8, written per HF tensor: its bytes and scales as stored where the
    output keeps FP8, else dequantized (``OutputDtypes.stored_tensors``)."""
    for h, (q, s) in zip(hf_names, pairs):
        if not allow_nonfinite:
            check_finite_fp8(q, s, f"{h} (Megatron {name})", model_path)
        for name_out, t_out in out_dtype.stored_tensors(h, q, s, block):
            writer.write(name_out, t_out)
        bar.update(q.numel() + s.numel() * 4)


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
    before the weight is split into HF tensors (gate/up halves, per-expert names). Weights the checkpoint
    stores in FP8 (``checkpoint.fp8_sharded``) are written as stored where the output keeps FP8, an adapted
    one dequantized, merged and re-quantized (``convert.fp8_stored.merged_weight``)."""
    root = Path(ckpt)
    check_output(out, kind, [root], overwrite)
    model_path = model_dir(root, iteration)
    if not (model_path / "metadata.json").is_file():
        raise FileNotFoundError(f"{model_path}: not a Megatron-Core distributed checkpoint (no metadata.json)")
    if megatron_lm.is_foreign(root):  # Megatron-LM / Bridge: config from the checkpoint's own
        glm5, hf_config, meta_dir = megatron_lm.hf_side(root, iteration)
        hf_config = {k: v for k, v in hf_config.items() if k not in ("dtype", "torch_dtype")}  # the checkpoint's
    else:
        if not (root / "hf" / "config.json").is_file():
            raise FileNotFoundError(f"{root / 'hf' / 'config.json'}: missing; the checkpoint has no HF config")
        glm5, meta_dir = checkpoint_config(root, iteration), root / "hf"  # MTP as stored (a notice)
        hf_config = json.loads((root / "hf" / "config.json").read_text())
    td = checkpoint_dtype(model_path)
    max_bytes = _parse_size(max_shard_size)
    model = meta_model(glm5, td)
    sharded = model.sharded_state_dict()
    fp8, block = stored_fp8_names(sharded, model_path)  # the weights stored in FP8, read and written as stored
    out_dtype = OutputDtypes(meta_dir, hf_config, td, dtype, block)
    tensors = named_tensors(model)
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
    nbytes = {n: stored_nbytes(t, fp8.get(n)) for n, t in tensors.items()}
    bar = Progress(sum(nbytes.values()), len(plan), "mcore-to-hf", progress)
    checks = StreamVerifier(model_path)  # checksums of the bytes the loader reads, decided before publishing
    with verified_run(checks, bar):
        with output_dir(out, kind, [root], overwrite) as tmp, contextlib.ExitStack() as stack, bulk_io():
            writer = PlannedSafetensorsWriter(tmp, plan, max_bytes)
            stack.callback(writer.close)
            merged: set[str] = set()
            loader = stack.enter_context(GroupLoader(model, model_path, checks, sharded, fp8))
            # Units of at most a quarter of an output shard (a full-size GLM-5 MoE layer, ~19 GB, is
            # cut into slices of its experts): the next loads while this one is written, and the two
            # in memory stay within half a shard; the process itself (torch, Megatron-Core, the meta
            # model) takes about 1 GB more.
            units = slice_units(groups, nbytes, max(1, max_bytes // 4))
            largest = max(sum(nbytes[n] for n in names) for _, names in units)
            for names, loaded in loader.stream(units, ahead=2 * largest <= max_bytes):
                for name in names:
                    t = loaded[name]
                    src = hf_source(name, glm5.num_hidden_layers)
                    target = name[: -len(".weight")] if name.endswith(".weight") else None
                    merging = merge_adapter is not None and target in merge_adapter.A
                    if name in fp8:  # stored as e4m3 + block scales
                        pairs = stored_parts(t, loaded[name + SCALE_SUFFIX], len(src.names))
                        if not merging:
                            _write_stored(writer, out_dtype, src.names, pairs, fp8[name], name, model_path,
                                          allow_nonfinite, bar)
                            continue
                        t = merged_weight(pairs, fp8[name], merge_adapter.delta(target))  # re-quantized on write
                        merged.add(target)
                    elif isinstance(t, (list, tuple)) and (len(t) != len(src.names) or merging):
                        t = torch.cat(list(t), 0)
                    if merging and name not in fp8:
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
            if out_dtype.fp8_written:  # the checkpoint's HF origin's, in the block size written
                config["quantization_config"] = {**hf_config.get("quantization_config", QUANTIZATION_CONFIG),
                                                 "weight_block_size": [out_dtype.block, out_dtype.block]}
            (tmp / "config.json").write_text(json.dumps(config, indent=2))
            for name in HF_META_FILES:
                if name != "config.json" and meta_dir is not None and (meta_dir / name).is_file():
                    (tmp / name).write_bytes((meta_dir / name).read_bytes())
            checks.result()
    return Path(out)

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

A frozen base the HF folder stores in FP8 stays FP8: e4m3 bytes + block scales as stored, both ways
(``convert.fp8_stored``; the checkpoint format is ``checkpoint.fp8_sharded``).

Every check that can fail (missing / unmapped / mis-shaped / mis-typed tensors, corrupt files) runs
before anything is written; the output folder is built under a temporary name and renamed only when
complete, so a previous good output survives any failure. ``--out`` is guarded (``atomic.output_dir``:
never an input, never a folder of something else); inputs are verified against their checksum
manifests, the output gets one; a NaN/Inf weight is an error naming the tensor (``allow_nonfinite``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from glm5_mcore.checkpoint.atomic import check_output, output_dir
from glm5_mcore.checkpoint.layout import iter_dir, write_hf_meta
from glm5_mcore.checkpoint.checks import check_finite
from glm5_mcore.config import GLM5Config
from glm5_mcore.convert.dcp_write import lazy_dcp_save, reraise_nonfinite
from glm5_mcore.checkpoint.direct_io import bulk_io
from glm5_mcore.convert.out_dtypes import DTYPES, HF_DTYPE_NAMES
from glm5_mcore.checkpoint.hf_io import FP8, HFCheckpoint
from glm5_mcore.checkpoint.hf_names import hf_source

from glm5_mcore.checkpoint.folder_config import hf_dir_config
from glm5_mcore.checkpoint.manifest import StreamVerifier, write_manifest
from glm5_mcore.convert.common import Progress, meta_model, named_tensors, verified_run
from glm5_mcore.convert.fp8_stored import keep_fp8, stored_ids, stored_part

_FLOAT = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# --------------------------------------------------------------------------------------------------
# HF -> Megatron
# --------------------------------------------------------------------------------------------------
class _HFSourcePlan:
    """For every Megatron tensor of the meta model: its HF parts, checked against the files."""

    def __init__(self, model, glm5: GLM5Config, ckpt: HFCheckpoint, allow_nonfinite: bool = False):
        self.ckpt, self.allow_nonfinite = ckpt, allow_nonfinite
        self.tensors = named_tensors(model)
        # what a write item is a view of: a tensor (part None), or a kept FP8 weight's e4m3 data / scales
        self.by_id = {id(t): (n, None) for n, t in self.tensors.items()}
        self.by_id.update(stored_ids(self.tensors))
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
                self.total_bytes += sum(ckpt.info(k)[3] for k in ckpt.stored_names_for(h)[1:]) + nbytes
            self.sources[name] = src
        unmapped = [k for k in ckpt.keys() if k not in needed_stored]
        if unmapped:
            listed = ", ".join(f"{k} ({ckpt.files[k].name})" for k in unmapped[:5])
            raise ValueError(f"{ckpt.dir}: {len(unmapped)} tensor(s) the GLM-5 name table does not map "
                             f"for this config: {listed}")

    def position(self, view: torch.Tensor) -> tuple[str, int]:
        """Where the first HF bytes ``view`` is made from lie: (file, byte offset)."""
        base = view._base if view._base is not None else view
        name, part = self.by_id[id(base)]
        stored, expert, _ = self.ckpt.locate(self.sources[name].names[0])
        stored = stored + "_scale_inv" if part == "scale" else stored
        path = self.ckpt.files[stored]
        _, shape, start, end = self.ckpt._file(path).tensors[stored]
        return str(path), start + (expert or 0) * ((end - start) // max(1, shape[0]))

    def resolve(self, view: torch.Tensor) -> torch.Tensor:
        """The real data of ``view``, a meta param or a (factory) view of one."""
        base = view._base if view._base is not None else view
        name, part = self.by_id[id(base)]
        src = self.sources[name]
        names = src.names
        offset = view.storage_offset() - base.storage_offset()
        if src.is_glu:  # read only the half the view lies in
            half = base.numel() // 2
            if offset >= half:
                names, offset = names[1:], offset - half
            elif offset + view.numel() <= half and view.is_contiguous():
                names = names[:1]
        if part is not None:  # a kept FP8 weight: its bytes or scales as stored
            parts = [stored_part(self.ckpt, h, part, self.allow_nonfinite) for h in names]
        else:
            parts = [self.ckpt.get(h).to(base.dtype) for h in names]
            if not self.allow_nonfinite:
                for h, t in zip(names, parts):
                    check_finite(t, h, self.ckpt.files[self.ckpt.locate(h)[0]])
        full = (parts[0] if len(parts) == 1 else torch.cat(parts, 0)).contiguous()
        return full.as_strided(view.size(), view.stride(), full.storage_offset() + offset).contiguous()


def hf_to_mcore(hf_dir: str | Path, out: str | Path, workers: int = 1, dtype: Optional[str] = None,
                progress: bool = True, overwrite: bool = False, allow_nonfinite: bool = False,
                dequantize_fp8: bool = False) -> Path:
    """Convert an HF GLM-5 folder into ``out`` (``iter_0000000/model``, ``hf/``, ``latest``). The linears an
    FP8 release stores in FP8 stay so, bytes and block scales as stored (``convert.fp8_stored``; ``hf/config.json``
    keeps the folder's ``quantization_config``); ``dequantize_fp8``: every tensor dense in ``dtype`` (what
    Megatron-LM / Bridge load), ``quantization_config`` still kept: the origin's block size, in which
    ``model.base_dtype=fp8`` quantizes the base again (the release's bytes where the scales were canonical) and
    ``mcore-to-hf`` writes the tensors the origin stored in FP8."""
    hf_dir = Path(hf_dir)
    check_output(out, "convert hf-to-mcore", [hf_dir], overwrite)
    checks = StreamVerifier(hf_dir)  # an HF folder we wrote (mcore-to-hf) has a manifest: checked from the reads
    glm5 = hf_dir_config(hf_dir)  # MTP layers the weights lack are left out (a notice)
    ckpt = HFCheckpoint(hf_dir, checks)
    if dtype is None:
        td = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}.get(
            glm5.torch_dtype, torch.bfloat16)
    elif dtype in DTYPES:
        td = DTYPES[dtype]
    else:
        raise ValueError(f"--dtype {dtype}: expected one of {sorted(DTYPES)}")
    model = meta_model(glm5, td)
    if not dequantize_fp8:
        keep_fp8(model, named_tensors(model), glm5.num_hidden_layers, ckpt)
    plan = _HFSourcePlan(model, glm5, ckpt, allow_nonfinite)
    bar = Progress(plan.total_bytes, sum(len(s.names) for s in plan.sources.values()), "hf-to-mcore", progress)
    with verified_run(checks, bar):
        with output_dir(out, "convert hf-to-mcore", [hf_dir], overwrite, manifest=False) as tmp, bulk_io():
            try:
                lazy_dcp_save(model, iter_dir(tmp, 0) / "model", plan, workers, bar.update)
            except BaseException as e:
                reraise_nonfinite(e)
                raise
            config = json.loads((hf_dir / "config.json").read_text())  # quantization_config kept, dense or not
            config["dtype"] = HF_DTYPE_NAMES[td]
            config.pop("torch_dtype", None)
            write_hf_meta(tmp / "hf", hf_dir, config)
            (iter_dir(tmp, 0) / "trainer_state.json").write_text(json.dumps({"iteration": 0}, indent=2))
            write_manifest(iter_dir(tmp, 0))
            (tmp / "latest").write_text("0\n")
            checks.result()  # before the output is renamed into place
    return Path(out)

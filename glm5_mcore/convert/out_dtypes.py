"""The dtype each HF tensor is written in by ``glm5 convert mcore-to-hf`` / ``lora export --merged``.

Default: the dtype the checkpoint's HF origin stored it in (``hf/dtypes.json``, ``stored.record_dtypes``),
so a round trip gives back the same bytes whatever config.json's ``dtype`` says; tensors with no
record (no HF origin, a fresh MTP layer) get config.json's ``dtype`` (the router: fp32). ``--dtype``
overrides: bf16 / fp16 / fp32 (the router stays fp32), or fp8: the release's FP8 block format
(``glm5_mcore.checkpoint.fp8``) for the projections, bf16 (router fp32) for the rest. Weights the checkpoint
stores in FP8 (``checkpoint.fp8_sharded``) go out as their stored bytes where the output is FP8 in their
block size (``stored_tensors``), dequantized where it is not.
"""

from __future__ import annotations

import collections
import json
from pathlib import Path
from typing import Optional

import torch

from glm5_mcore.checkpoint.fp8 import is_quantized, quantize_fp8_blocks, scale_shape
from glm5_mcore.checkpoint.hf_io import DTYPES as ST_DTYPES
from glm5_mcore.checkpoint.hf_io import FP8, FP8_BLOCK, dequantize_fp8_blocks, weight_block_size
from glm5_mcore.checkpoint.hf_names import FP32_HF_SUFFIXES
from glm5_mcore.checkpoint.dtypes import read_dtypes, stored_dtype

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
HF_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}


class OutputDtypes:
    """The dtype each HF tensor is written in by ``mcore_to_hf`` (see there), and FP8 quantization."""

    def __init__(self, hf_meta: Optional[Path], hf_config: dict, ckpt_dtype: torch.dtype, override: Optional[str],
                 block: Optional[int] = None):
        """``hf_meta``: the folder holding the dtype record (a checkpoint's ``hf/``; None: no HF origin);
        ``hf_config``: the config.json written out; ``block``: the FP8 block size the checkpoint stores its FP8
        weights in (None: none stored; FP8 is then written in ``hf_meta``'s ``quantization_config`` blocks, 128
        without one)."""
        if override is not None and override not in (*DTYPES, "fp8"):
            raise ValueError(f"--dtype {override}: expected one of {sorted(DTYPES) + ['fp8']}")
        self.override = override
        self.record = read_dtypes(hf_meta) if override is None and hf_meta is not None else None
        config_dtype = hf_config.get("dtype", hf_config.get("torch_dtype"))
        names = {v: k for k, v in HF_DTYPE_NAMES.items()}
        self.default = names.get(config_dtype, ckpt_dtype)
        self.fp8_written = False
        self.block = block if block is not None else weight_block_size(hf_meta) if hf_meta is not None else FP8_BLOCK

    def dtype(self, hf_name: str) -> torch.dtype:
        """The stored dtype of ``hf_name`` (``torch.float8_e4m3fn``: FP8 block format)."""
        if self.override == "fp8":
            if is_quantized(hf_name):
                return torch.float8_e4m3fn
            return torch.float32 if hf_name.endswith(FP32_HF_SUFFIXES) else torch.bfloat16
        if self.override is not None:
            return torch.float32 if hf_name.endswith(FP32_HF_SUFFIXES) else DTYPES[self.override]
        recorded = stored_dtype(self.record, hf_name)
        if recorded is not None:
            return ST_DTYPES[recorded]
        return torch.float32 if hf_name.endswith(FP32_HF_SUFFIXES) else self.default

    def plan(self, hf_name: str, shape: tuple) -> list:
        d = self.dtype(hf_name)
        if d in FP8:
            if len(shape) != 2:
                raise ValueError(f"{hf_name}: recorded as FP8 but has shape {list(shape)} (FP8 blocks need 2-D)")
            return [(hf_name, torch.float8_e4m3fn, tuple(shape)), (hf_name + "_scale_inv", torch.float32,
                                                                    scale_shape(tuple(shape), self.block))]
        return [(hf_name, d, tuple(shape))]

    def tensors(self, hf_name: str, t: torch.Tensor) -> list:
        d = self.dtype(hf_name)
        if d in FP8:
            q, s = quantize_fp8_blocks(t, self.block)
            self.fp8_written = True
            return [(hf_name, q), (hf_name + "_scale_inv", s)]
        return [(hf_name, t.to(d))]

    def stored_tensors(self, hf_name: str, q: torch.Tensor, s: torch.Tensor, block: int) -> list:
        """What ``tensors`` writes for ``hf_name`` held as stored FP8 (e4m3 ``q``, scales ``s`` in ``block``
        blocks): ``q`` and ``s`` themselves where the output is FP8 in that block size (the bytes as they
        came), else the weight dequantized per block."""
        if self.dtype(hf_name) in FP8 and block == self.block:
            self.fp8_written = True
            return [(hf_name, q), (hf_name + "_scale_inv", s)]
        return self.tensors(hf_name, dequantize_fp8_blocks(q, s, block))

    def config_dtype(self, plan: list) -> str:
        """config.json's ``dtype``: the most common non-FP8, non-fp32-router dtype written."""
        counts = collections.Counter(d for n, d, _ in plan if d in HF_DTYPE_NAMES and not n.endswith(
            FP32_HF_SUFFIXES) and not n.endswith("_scale_inv"))
        if not counts:
            return HF_DTYPE_NAMES.get(self.default, "bfloat16")
        return HF_DTYPE_NAMES[counts.most_common(1)[0][0]]

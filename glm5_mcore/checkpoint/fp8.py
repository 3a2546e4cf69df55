"""FP8 out, in the block format GLM-5-FP8 ships and ``hf_io.HFCheckpoint`` reads back.

Each quantized weight ``W [M, N]`` is stored as ``float8_e4m3fn`` with an fp32 ``weight_scale_inv
[ceil(M/128), ceil(N/128)]``: per 128×128 block ``s = amax(|W_block|) / 448`` and ``q = W / s`` rounded
to e4m3, so ``q·s`` (``hf_io.dequantize_fp8_blocks``) is W to e4m3's relative precision (2^-4 at
worst, half an ulp of a 3-bit mantissa). A block's largest entry maps to ±448 exactly, so
quantizing a dequantized weight again gives the same bytes (import ∘ export is the identity on FP8
folders).

Quantized: the 2-D projections of the decoder and MTP layers (attention q/kv/o, indexer wq_b/wk,
dense / shared / routed expert MLPs), as DeepSeek-V3-style FP8 releases do. Kept as they are:
embeddings, ``lm_head``, norms, the router (``mlp.gate``, fp32), the indexer's ``weights_proj`` and
the MTP ``eh_proj`` (vLLM builds those unquantized).
"""

from __future__ import annotations

import re

import torch

from glm5_mcore.checkpoint.hf_io import FP8_BLOCK

E4M3_MAX = 448.0
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}

_QUANTIZED = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|indexer\.wq_b|indexer\.wk)"
    r"|mlp\.(shared_experts\.|experts\.\d+\.)?(gate_proj|up_proj|down_proj))\.weight$")


def is_quantized(hf_name: str) -> bool:
    """Whether an FP8 export stores ``hf_name`` (an on-disk per-expert HF name) in FP8."""
    return _QUANTIZED.match(hf_name) is not None


def scale_shape(shape: tuple[int, ...], block: int = FP8_BLOCK) -> tuple[int, int]:
    M, N = shape
    return (M + block - 1) // block, (N + block - 1) // block


def quantization_config(block: int = FP8_BLOCK) -> dict:
    """config.json's ``quantization_config`` of an FP8 folder in ``block``-square blocks."""
    return {**QUANTIZATION_CONFIG, "weight_block_size": [block, block]}


def quantize_state_dict(state_dict: dict[str, torch.Tensor], block: int = FP8_BLOCK) -> dict[str, torch.Tensor]:
    """An HF on-disk state dict as an FP8 release stores it: every ``is_quantized`` weight as e4m3 +
    ``{name}_scale_inv`` (``quantize_fp8_blocks``), the rest unchanged."""
    out = {}
    for k, v in state_dict.items():
        if is_quantized(k):
            out[k], out[k + "_scale_inv"] = quantize_fp8_blocks(v, block)
        else:
            out[k] = v
    return out


def quantize_fp8_blocks(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``W [M, N]`` → (e4m3 ``[M, N]``, fp32 ``weight_scale_inv [ceil(M/b), ceil(N/b)]``); edge blocks may be
    partial. An all-zero block gets scale 1."""
    if w.dim() != 2:
        raise ValueError(f"FP8 block quantization needs a 2-D weight, got shape {tuple(w.shape)}")
    M, N = w.shape
    bm, bn = scale_shape((M, N), block)
    wf = w.float()
    padded = torch.zeros(bm * block, bn * block, dtype=torch.float32)
    padded[:M, :N] = wf
    amax = padded.view(bm, block, bn, block).abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    s = scale.repeat_interleave(block, 0)[:M].repeat_interleave(block, 1)[:, :N]
    q = (wf / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale

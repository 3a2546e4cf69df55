"""Bytes an adapter push sends to one rollout engine per step.

In vLLM's LoRA mode (``rl.rollout.vllm_lora``, the default) a push sends the adapter's own tensors for every family
vLLM serves as LoRA (``lora_push_bytes``: rank × (in + out) numbers per linear, the routed experts in PEFT's fused 3D
form, in the payload's dtype) and merges the others (``linear_kv_up_proj``) as below.

A merged push sends ``W + scale·B·A`` for every weight a non-zero adapter touches, in the dtype the engine
serves it (FP8: 1 byte per element + one fp32 scale per 128×128 block; else bf16), and whole vLLM modules:
``fused_qkv_a_proj`` = q_down + kv_down, ``gate_up_proj`` = fc1 (gate and up), and one ``FusedMoE`` per layer
= every routed expert's fc1 and fc2. So one adapter on any routed expert pushes that layer's 256 experts:
with the routed experts adapted, a GLM-5 push is the whole model, ~45x the default targets' (``configs/lora``)."""

from __future__ import annotations

from glm5_mcore.config import GLM5Config
from glm5_mcore.lora.config import VLLM_LORA
from glm5_mcore.plan.layout import Layout
from glm5_mcore.plan.params import lora_tensors, stage_tensors

MODULES = {"linear_q_down_proj": ("linear_q_down_proj", "linear_kv_down_proj"),
           "linear_kv_down_proj": ("linear_q_down_proj", "linear_kv_down_proj"),
           "experts.linear_fc1": ("experts.linear_fc1", "experts.linear_fc2"),
           "experts.linear_fc2": ("experts.linear_fc1", "experts.linear_fc2")}
"""A target -> the Megatron families its vLLM module holds (a push brings whole modules)."""


def merged_push_bytes(m: GLM5Config, targets, fp8: bool) -> dict[str, int]:
    """{Megatron family: bytes} one merged push sends one engine (the decoder, no MTP layer); ``fp8``: the
    engine serves the release's FP8 linears as FP8 (``quantization: fp8``)."""
    names = {n for t in targets for n in MODULES.get(t, (t,))}
    out: dict[str, int] = {}
    for g in stage_tensors(m, Layout(world=1), 0, mtp=False):
        if g.lora_mode is not None and g.name in names:
            out[g.name] = out.get(g.name, 0) + (g.fp8_bytes if fp8 and g.fp8 else 2 * g.total)
    return out


def lora_push_bytes(m: GLM5Config, targets, rank: int, fp8: bool, dtype_bytes: int = 2) -> dict[str, int]:
    """{Megatron family: bytes} one LoRA-mode push sends one engine (the decoder): the adapter tensors of the families
    vLLM serves as LoRA (``dtype_bytes`` each: 2 for the bf16 payload of a ``trainer.bf16`` run), plus the merged
    push of the ones it merges (``merged_push_bytes``, under ``merged:<family>``)."""
    served = [t for t in targets if t in VLLM_LORA]
    out: dict[str, int] = {}
    base = stage_tensors(m, Layout(world=1), 0, mtp=False)
    for g, lo in zip([g for g in base if g.lora_mode is not None and g.name in served],
                     lora_tensors(base, Layout(world=1), tuple(served), rank, freeze_indexer=False)):
        fam = lo.name.removeprefix("lora.")
        extra = rank * g.shape[1] * g.count if fam == "linear_fc1" else 0  # PEFT's gate and up each carry the A
        out[fam] = out.get(fam, 0) + dtype_bytes * (lo.total + extra)
    merged = [t for t in targets if t not in VLLM_LORA]
    out.update({f"merged:{k}": v for k, v in merged_push_bytes(m, merged, fp8).items()})
    return out

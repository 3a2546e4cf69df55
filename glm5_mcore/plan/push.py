"""Bytes a merged adapter push sends to one rollout engine per step (``rl.rollout.vllm_weights.iter_merged_weights``).

A merged push sends ``W + scale·B·A`` for every weight a non-zero adapter touches, in the dtype the engine
serves it (FP8: 1 byte per element + one fp32 scale per 128×128 block; else bf16), and whole vLLM modules:
``fused_qkv_a_proj`` = q_down + kv_down, ``gate_up_proj`` = fc1 (gate and up), and one ``FusedMoE`` per layer
= every routed expert's fc1 and fc2. So one adapter on any routed expert pushes that layer's 256 experts:
with the routed experts adapted, a GLM-5 push is the whole model, ~45x the default targets' (``configs/lora``)."""

from __future__ import annotations

from glm5_mcore.config import GLM5Config
from glm5_mcore.plan.layout import Layout
from glm5_mcore.plan.params import stage_tensors

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

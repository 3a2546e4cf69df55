"""vLLM-CPU serving LoRA on GLM-5's routed experts: vLLM 0.32's own LoRA path with only its GPU kernels replaced
by torch references of their contract. A test helper, imported in the vLLM process before the engine is built
(``VLLMRolloutEngine(server_imports=("tests.support.vllm_moe_lora_shim",))``); it imports vLLM and torch only.

Why a shim: on vLLM-CPU, ``enable_lora`` breaks every request of an MoE model (shared/notes/vllm-moe-lora §1.4):
LoRA forces the Triton fused-MoE backend (``fused_moe/oracle/unquantized.py:234-248``) and the CPU wheel's Triton
has no CPU backend (``experts/triton_moe.py:322``: ``triton.language`` has no ``float32``); ``PunicaWrapperCPU``
has no ``add_lora_w13`` / ``add_lora_w2`` (``lora/punica_wrapper/punica_base.py:523`` / ``:552`` raise
``NotImplementedError``); the ``_moe_C`` ops the GPU path calls are not built. What is replaced, and nothing else:

- ``TritonExperts.apply``: the base fused-MoE GEMMs (unquantized) in torch, calling vLLM's own
  ``LoRAExpertsMixin.apply_w13_lora`` / ``apply_w2_lora`` where ``triton_moe.py:476-494`` / ``:597-613`` call them;
- ``PunicaWrapperCPU.add_lora_w13`` / ``add_lora_w2``: the contract of ``punica_gpu.py:527-661`` / ``:663-768``
  (w13: ``y[t, j, slice s] += B_s[l, e] A_s[l, e] x[t]``; w2 with ``mul_routed_weight``:
  ``y[t, j] += w[t, j] B[l, e] A[l, e] x[t·k + j]``), for adapter slot ``l`` of token ``t`` from vLLM's own
  ``token_lora_indices``, expert ``e = topk_ids[t, j]``.

Everything else is vLLM's: PEFT parsing, the 3D → 2D conversion of PEFT's fused expert form
(``enable_mixed_moe_lora_format``), per-expert stacking, ``FusedMoEWithLoRA.set_lora``, ``MoELoRAContext``, the
punica token → slot mapping, the sampler. ``CALLS`` counts the replaced kernels' calls (a test asserts the
routed experts' LoRA ran). The real Triton kernels are ``bench/gpu_check.py``'s ``vllm_moe_lora`` stage."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from vllm.lora.punica_wrapper.punica_base import PunicaWrapperBase
from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU
from vllm.model_executor.layers.fused_moe.experts import triton_moe

CALLS = {"w13": 0, "w2": 0, "lora_tokens": 0, "experts_apply": 0}

if PunicaWrapperCPU.add_lora_w13 is not PunicaWrapperBase.add_lora_w13:  # pragma: no cover - a newer vLLM
    raise RuntimeError("vLLM-CPU now has its own add_lora_w13: the MoE-LoRA shim is obsolete, remove it")


def _slots(self, token_lora_mapping, num_tokens: int) -> torch.Tensor:
    m = token_lora_mapping if token_lora_mapping is not None else self.token_lora_indices
    return m[:num_tokens]


def add_lora_w13(self, y, x, lora_a_stacked, lora_b_stacked, topk_ids, topk_weights, expert_map, w1, w2,
                 num_tokens, top_k_num, max_loras, adapter_enabled, local_num_experts, top_k, num_slices,
                 fully_sharded, use_tuned_config, add_inputs=True, token_lora_mapping=None):
    """``y [T·k, num_slices·n]`` += each token's adapter on its experts' gate and up projections (w1, w3)."""
    CALLS["w13"] += 1
    slots = _slots(self, token_lora_mapping, num_tokens)
    yv = y.view(num_tokens, top_k_num, -1)
    if not add_inputs:
        yv.zero_()
    n = lora_b_stacked[0].shape[-2]
    for t in range(num_tokens):
        lora = int(slots[t])
        if lora < 0 or not int(adapter_enabled[lora]):
            continue
        CALLS["lora_tokens"] += 1
        for j in range(top_k_num):
            e = int(topk_ids[t, j])
            for s in range(num_slices):
                a, b = lora_a_stacked[s][lora, e], lora_b_stacked[s][lora, e]
                yv[t, j, s * n:(s + 1) * n] += (b @ (a @ x[t].to(a.dtype))).to(y.dtype)
    return None, topk_ids, None, slots


def add_lora_w2(self, y, x, lora_a_stacked, lora_b_stacked, topk_weights, sorted_token_ids_lora, expert_ids_lora,
                num_tokens_post_padded_lora, token_lora_mapping, num_tokens, w1, w2, top_k_num, max_loras,
                adapter_enabled, top_k, fully_sharded, tp_rank, use_tuned_config, add_inputs=True):
    """``y [T, k, H]`` += each token's adapter on its experts' down projection, times the router weight."""
    CALLS["w2"] += 1
    topk_ids = expert_ids_lora  # add_lora_w13's second return value, as vLLM passes it on
    yv = y.view(num_tokens, top_k_num, -1)
    if not add_inputs:
        yv.zero_()
    for t in range(num_tokens):
        lora = int(token_lora_mapping[t])
        if lora < 0 or not int(adapter_enabled[lora]):
            continue
        for j in range(top_k_num):
            e = int(topk_ids[t, j])
            a, b = lora_a_stacked[0][lora, e], lora_b_stacked[0][lora, e]
            yv[t, j] += (topk_weights[t, j] * (b @ (a @ x[t * top_k_num + j].to(a.dtype)))).to(y.dtype)


def experts_apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input):
    """``TritonExperts.apply`` (unquantized, no EP) in torch: w13 GEMM, vLLM's ``apply_w13_lora``, SiLU·mul, w2
    GEMM times the router weights, vLLM's ``apply_w2_lora``, the sum over the top-k."""
    if expert_map is not None or a1q_scale is not None:
        raise NotImplementedError("vllm_moe_lora_shim: unquantized experts without expert parallel only")
    CALLS["experts_apply"] += 1
    T, k = topk_ids.shape
    ids = topk_ids.long()
    c1 = torch.einsum("th,tknh->tkn", hidden_states, w1[ids]).contiguous()
    ctx = self._lora_context
    meta = (None, None, None, None)
    if ctx is not None:
        meta = self.apply_w13_lora(ctx, y=c1, x=hidden_states, topk_ids=topk_ids, topk_weights=topk_weights,
                                   expert_map=expert_map, w1=w1, w2=w2, num_tokens=T, top_k_num=k)
    inter = c1.shape[-1] // 2
    c2 = (F.silu(c1[..., :inter]) * c1[..., inter:]).reshape(T * k, inter).contiguous()
    c3 = torch.einsum("tki,tkhi->tkh", c2.view(T, k, inter), w2[ids])
    if not apply_router_weight_on_input:
        c3 = c3 * topk_weights[..., None].to(c3.dtype)
    c3 = c3.contiguous()
    if ctx is not None:
        self.apply_w2_lora(ctx, y=c3, x=c2, topk_weights=topk_weights, sorted_token_ids_lora=meta[0],
                           expert_ids_lora=meta[1], num_tokens_post_padded_lora=meta[2],
                           token_lora_mapping=meta[3], num_tokens=T, w1=w1, w2=w2, top_k_num=k)
    output.copy_(c3.sum(1))


PunicaWrapperCPU.add_lora_w13 = add_lora_w13
PunicaWrapperCPU.add_lora_w2 = add_lora_w2
triton_moe.TritonExperts.apply = experts_apply

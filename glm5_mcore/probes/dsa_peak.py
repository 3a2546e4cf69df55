"""One DSA layer's core (``GLM5SparseAttention``: Megatron-Core's indexer, the device path's chunked
top-k, the absorbed sparse core, W_uv) run forward and backward at GLM-5's full width on the meta device,
with ``LiveBytes`` booking every tensor it makes: the peak above its inputs, for the planner's DSA line
(``glm5_mcore.plan.activations.dsa_core_peak``). Meta tensors are fake tensors: nothing is allocated,
and they take the accelerator path (``kernels.use_for`` is false off the CPU), so 32K tokens cost
seconds.

One rank of TP ``tp`` without context parallelism: the core sees ``heads / tp`` query heads and every
token's latent row; x and qr come in as the sequence-parallel gather hands them to the indexer."""

from __future__ import annotations

import torch

from glm5_mcore import cpu_compat
from glm5_mcore.config import GLM5Config
from glm5_mcore.model.layer_spec import get_backend, get_glm5_attention_spec
from glm5_mcore.probes.live_bytes import LiveBytes


def build_core(m: GLM5Config):
    """The first DSA layer's core of ``m`` on the meta device, bf16, PyTorch path (parallel state: one rank)."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module

    from glm5_mcore.mcore_settings import ParallelConfig

    cpu_compat.apply()
    cfg = m.to_mcore_config(ParallelConfig(), transformer_impl="local", dsa_kernel_backend="none",
                            params_dtype=torch.bfloat16, bf16=True)
    spec = get_glm5_attention_spec(cfg, get_backend("local")).submodules.core_attention
    with torch.device("meta"):
        core = build_module(spec, config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                            attention_type="self")
    rope = core.indexer.rotary_pos_emb
    rope.inv_freq = rope.inv_freq.to("meta")  # a plain attribute made on the CPU (rotary_pos_embedding.py:78)
    return core


def measure_core_peak(m: GLM5Config, tokens: int, tp: int, core=None) -> dict:
    """Peak live bytes of the core's forward + backward above its inputs (query, MLA key and value, the
    kv latent, x, qr, the incoming gradient), and the bytes still held between forward and backward."""
    core = core if core is not None else build_core(m)
    core.train()
    n = m.num_attention_heads // tp
    dn, dr, dv, dc = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    T, bf = tokens, dict(dtype=torch.bfloat16, device="meta")
    query = torch.empty(T, 1, n, dn + dr, **bf, requires_grad=True)
    key = torch.empty(T, 1, n, dn + dr, **bf, requires_grad=True)
    value = torch.empty(T, 1, n, dv, **bf)
    latent = torch.empty(T, 1, dc, **bf, requires_grad=True)
    x, qr = torch.empty(T, 1, m.hidden_size, **bf), torch.empty(T, 1, m.q_lora_rank, **bf)
    with torch.device("meta"):
        kv_up = torch.nn.Linear(dc, n * (dn + dv), bias=False, dtype=torch.bfloat16)  # its weight: a parameter
    dout = torch.empty(T, 1, n * dv, **bf)
    core._kv_up, core._latent = [kv_up], latent
    live = LiveBytes([query, key, value, latent, x, qr, dout, *core.parameters(), *kv_up.parameters(),
                      core.indexer.rotary_pos_emb.inv_freq])
    with live:
        live.phase = "forward"
        out = core(query, key, value, None, x, qr)
        held, forward_peak = live.now, live.peak
        live.phase = "backward"
        out.backward(dout)
    return {"tokens": T, "tp": tp, "heads": n, "peak": live.peak, "phase": live.peak_phase, "held": held, "forward_peak": forward_peak,
            "at_peak": live.at_peak}

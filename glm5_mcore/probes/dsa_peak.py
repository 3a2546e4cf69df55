"""One DSA layer's core (``GLM5SparseAttention``: Megatron-Core's indexer, the device path's chunked
top-k, the absorbed sparse core, W_uv) run forward and backward at GLM-5's full width on the meta device,
with ``LiveBytes`` booking every tensor it makes: the peak above its inputs, for the planner's DSA lines
(``glm5_mcore.plan.activations.dsa_core_peak``). Meta tensors are fake tensors: nothing is allocated,
and they take the accelerator path (``kernels.use_for`` is false off the CPU), so 32K tokens cost
seconds.

One rank of TP ``tp`` and allgather CP ``cp``: the core sees ``heads / tp`` query heads and ``tokens / cp``
query rows; x and qr come in as the sequence-parallel gather hands them to the indexer. The training
stage (``STAGES``): ``sparse`` (frozen indexer), ``sparse_loss`` (trainable indexer, Megatron-Core's sparse
KL, ``dsa_indexer_loss_coeff`` > 0) or ``warmup`` (dense attention + the dense KL). CP ``cp`` > 1 is this
rank (rank 0) of a group whose other ranks hold the same tensors: the all-gather is a concatenation, as
large as the real one's output.

The warm-up's dense attention is PyTorch's SDPA, which on meta tensors takes its math path (a [b, n, S, T]
fp32 score tensor). On a GPU it takes a fused kernel with O(S) memory: flash attention unmasked,
memory-efficient attention with a mask (THD packing, CP), whose boolean [S, T] mask SDPA first turns
into an additive bias of the query's dtype. The probe runs the memory-efficient kernel's meta functions
(``aten._scaled_dot_product_efficient_attention`` and its backward: its outputs, gradients and saved
tensors), the bias made as SDPA makes it. What a kernel allocates inside (flash attention's fp32 dq
accumulator) is not seen; the planner adds it by reading (``plan.activations.warmup_peak``)."""

from __future__ import annotations

import contextlib
import types
from unittest import mock

import torch
import torch.nn.functional as F
from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler
from torch.overrides import TorchFunctionMode

from glm5_mcore import cpu_compat
from glm5_mcore.config import GLM5Config
from glm5_mcore.model import dsa as dsa_module
from glm5_mcore.model.layer_spec import get_backend, get_glm5_attention_spec
from glm5_mcore.model.sparse_attention import dense_attention
from glm5_mcore.probes.live_bytes import LiveBytes

STAGES = ("sparse", "sparse_loss", "warmup")
LOSS_COEFF = 0.001  # the recipes' default train.indexer_loss_coeff


def build_core(m: GLM5Config, stage: str = "sparse"):
    """The first DSA layer's core of ``m`` on the meta device, bf16, PyTorch path (parallel state: one
    rank), set up for ``stage``: the indexer frozen (``sparse``) or trainable with its loss."""
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import build_module

    from glm5_mcore.mcore_settings import ParallelConfig

    if stage not in STAGES:
        raise ValueError(f"stage={stage!r}: one of {', '.join(STAGES)}")
    cpu_compat.apply()
    cfg = m.to_mcore_config(ParallelConfig(), transformer_impl="local", dsa_kernel_backend="none",
                            params_dtype=torch.bfloat16, bf16=True,
                            dsa_indexer_loss_coeff=LOSS_COEFF if stage == "sparse_loss" else 0.0)
    spec = get_glm5_attention_spec(cfg, get_backend("local")).submodules.core_attention
    with torch.device("meta"):
        core = build_module(spec, config=cfg, layer_number=1, attn_mask_type=AttnMaskType.causal,
                            attention_type="self")
    rope = core.indexer.rotary_pos_emb
    rope.inv_freq = rope.inv_freq.to("meta")  # a plain attribute made on the CPU (rotary_pos_embedding.py:78)
    for p in core.indexer.parameters():
        p.requires_grad_(stage != "sparse")
    core.warmup_coeff = LOSS_COEFF if stage == "warmup" else 0.0
    return core


class _TwoRanks:
    """A process group of ``n`` seen from rank 0 (the core reads only its size and rank)."""

    def __init__(self, n: int):
        self.n = n

    def size(self):
        return self.n

    def rank(self):
        return 0


def _gather(t, group=None, **_):
    """The CP all-gather's output: every rank's rows (the same tensors here)."""
    return torch.cat([t] * group.size()) if isinstance(group, _TwoRanks) else t


class EfficientSDPA(TorchFunctionMode):
    """``F.scaled_dot_product_attention`` as a fused GPU kernel runs it: the memory-efficient kernel's meta
    functions (outputs, gradients), a boolean mask turned into an additive bias of the query's dtype
    [.., S, T] (as SDPA's ``convert_boolean_attn_mask`` does)."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        mask = kwargs.get("attn_mask")
        bias = None
        if mask is not None:
            bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
            bias = bias.expand(q.shape[0], q.shape[1], *mask.shape[-2:])
        return torch.ops.aten._scaled_dot_product_efficient_attention(
            q, k, v, bias, True, 0.0, bool(kwargs.get("is_causal", False)), scale=kwargs.get("scale"))[0]


def _masked_dense_attention(q, k, v, q_pos, doc_start, scale, plain_causal=False):
    """``dense_attention`` as packed (THD) documents or CP take it on a device: an explicit [S, T] mask."""
    return dense_attention(q, k, v, q_pos, doc_start, scale, plain_causal=False)


def measure_core_peak(m: GLM5Config, tokens: int, tp: int, core=None, stage: str = "sparse", cp: int = 1,
                      thd: bool = False) -> dict:
    """Peak live bytes of the core's forward + backward above its inputs (query, MLA key and value, the
    kv latent, x, qr, the incoming gradient), and the bytes still held between forward and backward, on one
    rank of TP ``tp`` x CP ``cp`` in training stage ``stage``. ``core``: one ``build_core(m, stage)`` made.
    ``thd``: as SFT and RL hand tokens over, packed (THD): the only memory it changes is the warm-up's dense
    attention, which then takes a causal + document mask [S, T] (the rest has the same shapes with or
    without packing; Megatron's local THD RoPE reads cu_seqlens on the host, which meta tensors cannot)."""
    core = core if core is not None else build_core(m, stage)
    core.train()
    n = m.num_attention_heads // tp
    dn, dr, dv, dc = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    S, bf = tokens // cp, dict(dtype=torch.bfloat16, device="meta")
    query = torch.empty(S, 1, n, dn + dr, **bf, requires_grad=True)
    key = torch.empty(S, 1, n, dn + dr, **bf, requires_grad=True)
    value = torch.empty(S, 1, n, dv, **bf, requires_grad=True)
    latent = torch.empty(S, 1, dc, **bf, requires_grad=True)
    x, qr = torch.empty(S, 1, m.hidden_size, **bf), torch.empty(S, 1, m.q_lora_rank, **bf)
    with torch.device("meta"):
        kv_up = torch.nn.Linear(dc, n * (dn + dv), bias=False, dtype=torch.bfloat16)  # its weight: a parameter
    dout = torch.empty(S, 1, n * dv, **bf)
    core._kv_up, core._latent = [kv_up], latent
    live = LiveBytes([query, key, value, latent, x, qr, dout, *core.parameters(), *kv_up.parameters(),
                      core.indexer.rotary_pos_emb.inv_freq])
    with contextlib.ExitStack() as stack:
        if cp > 1:
            stack.enter_context(mock.patch.object(core, "pg_collection",
                                                  types.SimpleNamespace(tp=core.pg_collection.tp, cp=_TwoRanks(cp))))
            stack.enter_context(mock.patch.object(dsa_module, "gather_from_sequence_parallel_region", _gather))
        # Megatron-Core makes the indexer loss's backward scale once, on the device of the first backward:
        # a meta one of its own here, the process's own put back after (a later CPU backward reads it)
        stack.enter_context(mock.patch.object(DSAIndexerLossAutoScaler, "main_loss_backward_scale",
                                              torch.tensor(1.0, device="meta")))
        stack.enter_context(EfficientSDPA())
        stack.enter_context(live)
        live.phase = "forward"
        if thd:
            stack.enter_context(mock.patch.object(dsa_module, "dense_attention", _masked_dense_attention))
        out = core(query, key, value, None, x, qr)
        held, forward_peak = live.now, live.peak
        live.phase = "backward"
        out.backward(dout)
    return {"tokens": tokens, "tp": tp, "cp": cp, "stage": stage, "heads": n, "peak": live.peak,
            "phase": live.peak_phase, "held": held, "forward_peak": forward_peak, "at_peak": live.at_peak}

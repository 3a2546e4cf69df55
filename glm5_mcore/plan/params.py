"""The tensors one rank of a layout holds, computed from the architecture (no model is built).

``stage_tensors`` lists every parameter and buffer Megatron-Core's ``GPTModel`` (as
``glm5_mcore.model.build.build_model`` specs it) creates on a rank of a pipeline stage, with its local
shape. Shapes per rank (H hidden, V vocab, h heads, M expert width, S shared-expert width, r rank):

    embedding / output layer     [V_pad/tp, H]      (first stage / last stage; MTP with PP > 1 keeps
                                                     its own embedding copy on the last stage; V_pad
                                                     the vocabulary padded for tp, ``Layout.vocab_rows``)
    q_down, kv_down, indexer      replicated         (Megatron's duplicated Linear)
    q_up, kv_up, dense fc1, shared fc1   [out/tp, in]  column-parallel
    linear_proj, dense fc2, shared fc2   [out, in/tp]  row-parallel
    routed experts                [2M/etp, H], [H, M/etp] × experts/ep  (ETP shards, EP splits)
    router weight, expert bias    fp32, replicated

``lora_tensors`` adds the adapters ``glm5_mcore.lora.apply.apply_lora`` would create for a target list
(column: A [r, in] B [out/tp, r]; row: A [r, in/tp] B [out, r]; replicated/experts: local shapes).
The exactness test (``tests/plan/test_plan.py``) checks these against the real model built per rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from glm5_mcore.config import GLM5Config
from glm5_mcore.model.fp8_linear import is_fp8_base_weight
from glm5_mcore.plan.layout import Layout

FP8_BLOCK = 128
"""The release's FP8 block edge (``weight_scale_inv`` per 128×128 block)."""


@dataclass(frozen=True)
class TensorGroup:
    """``count`` tensors of ``numel`` elements each, held by one rank."""

    name: str
    """Megatron module family, e.g. ``experts.linear_fc1`` or ``router``."""
    numel: int
    count: int = 1
    fp32: bool = False
    """Always fp32 (router weight, buffers), whatever the job's parameter dtype."""
    expert: bool = False
    """Routed-expert parameter: reduced and sharded over the expert-data-parallel group."""
    indexer: bool = False
    buffer: bool = False
    lora_mode: Optional[str] = None
    """For a linear LoRA can target: ``column``, ``row`` or ``none`` (replicated / expert)."""
    shape: tuple = ()
    """Local weight shape ``(out, in)`` of a linear."""
    fp8: bool = False
    """A linear the release stores in FP8 (``model.fp8_linear.is_fp8_base_weight``): with ``model.base_dtype=fp8``
    its frozen weight is 1 byte per element + one fp32 scale per 128×128 block of its local shape."""

    @property
    def total(self) -> int:
        return self.numel * self.count

    @property
    def fp8_bytes(self) -> int:
        """Bytes of all ``count`` tensors as a frozen FP8 base holds them (e4m3 data + fp32 block scales)."""
        o, i = self.shape
        return self.count * (o * i + 4 * (-(-o // FP8_BLOCK)) * (-(-i // FP8_BLOCK)))


def _linear(name, out_f, in_f, mode, count=1, where="self_attention", **kw) -> TensorGroup:
    """``count`` linears ``[out_f, in_f]``; ``where``: the module path inside a decoder layer, which decides
    (through the one HF name table) whether the release stores it in FP8."""
    fp8 = is_fp8_base_weight(f"decoder.layers.0.{where}.{name.split('.')[-1]}.weight", 1)
    return TensorGroup(name, out_f * in_f, count, lora_mode=mode, shape=(out_f, in_f), fp8=fp8, **kw)


def _norm(name, n, count=1, **kw) -> TensorGroup:
    return TensorGroup(name, n, count, **kw)


IDX = "self_attention.core_attention.indexer"


def _layer(m: GLM5Config, L: Layout, moe: bool, has_indexer: bool, n: int) -> list[TensorGroup]:
    """``n`` decoder layers of one kind (dense or MoE, with or without an indexer) on one rank."""
    H, tp, heads = m.hidden_size, L.tp, m.num_attention_heads // L.tp
    g = [
        _norm("input_layernorm", H, n),
        _linear("linear_q_down_proj", m.q_lora_rank, H, "none", n),
        _norm("q_layernorm", m.q_lora_rank, n),
        _linear("linear_q_up_proj", heads * m.qk_head_dim, m.q_lora_rank, "column", n),
        _linear("linear_kv_down_proj", m.kv_lora_rank + m.qk_rope_head_dim, H, "none", n),
        _norm("kv_layernorm", m.kv_lora_rank, n),
        _linear("linear_kv_up_proj", heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank, "column", n),
        _linear("linear_proj", H, heads * m.v_head_dim, "row", n),
        _norm("pre_mlp_layernorm", H, n),
    ]
    if has_indexer:
        g += [
            _linear("linear_wq_b", m.index_n_heads * m.index_head_dim, m.q_lora_rank, "none", n, IDX, indexer=True),
            _linear("linear_wk", m.index_head_dim, H, "none", n, IDX, indexer=True),
            _norm("indexer.k_norm", 2 * m.index_head_dim, n, indexer=True),
            _linear("linear_weights_proj", m.index_n_heads, H, "none", n, IDX, indexer=True),
        ]
    if not moe:
        ffn = m.intermediate_size // tp
        return g + [_linear("linear_fc1", 2 * ffn, H, "column", n, "mlp"), _linear("linear_fc2", H, ffn, "row", n, "mlp")]
    E, local, ew = m.n_routed_experts, m.n_routed_experts // L.ep, m.moe_intermediate_size // L.etp
    g += [
        TensorGroup("router", E * H, n, fp32=True),
        TensorGroup("router.expert_bias", E, n, fp32=True, buffer=True),
        TensorGroup("router.local_tokens_per_expert", E, n, fp32=True, buffer=True),
        _linear("experts.linear_fc1", 2 * ew, H, "none", n * local, "mlp.experts.local_experts.0", expert=True),
        _linear("experts.linear_fc2", H, ew, "none", n * local, "mlp.experts.local_experts.0", expert=True),
    ]
    if m.n_shared_experts:
        s = m.shared_expert_intermediate_size // tp
        g += [_linear("linear_fc1", 2 * s, H, "column", n, "mlp.shared_experts"),
              _linear("linear_fc2", H, s, "row", n, "mlp.shared_experts")]
    return g


def stage_tensors(m: GLM5Config, L: Layout, stage: int, mtp: bool) -> list[TensorGroup]:
    """Every parameter and buffer on a rank of pipeline ``stage`` (``mtp``: the model has its MTP layers)."""
    H, V = m.hidden_size, L.vocab_rows(m)
    first, last = stage == 0, stage == L.pp - 1
    mtp_layers = m.num_nextn_predict_layers if (mtp and last) else 0
    out: list[TensorGroup] = []
    if first or (mtp_layers and L.pp > 1):
        out.append(TensorGroup("embedding", V * H))
    kinds: dict[tuple, int] = {}
    for i in L.stage_layers(m, stage):
        key = (m.mlp_layer_types[i] == "sparse", m.indexer_types[i] == "full")
        kinds[key] = kinds.get(key, 0) + 1
    for (moe, idx), n in kinds.items():
        out += _layer(m, L, moe, idx, n)
    if last:
        out.append(_norm("final_layernorm", H))
        out.append(TensorGroup("output_layer", V * H))
    if mtp_layers:
        k = mtp_layers
        out += [_norm("mtp.enorm", H, k), _norm("mtp.hnorm", H, k), _norm("mtp.final_layernorm", H, k),
                TensorGroup("mtp.eh_proj", (H // L.tp) * 2 * H, k)]
        out += _layer(m, L, True, True, k)
    return out


def lora_tensors(groups: list[TensorGroup], L: Layout, targets: tuple, rank: int,
                 freeze_indexer: bool = True) -> list[TensorGroup]:
    """The LoRA A and B of every targeted linear in ``groups`` (``glm5_mcore.lora.apply`` shapes)."""
    out = []
    for g in groups:
        if g.lora_mode is None or g.name not in targets:
            continue
        o, i = g.shape  # local; column keeps the full input, row the full output
        out.append(TensorGroup(f"lora.{g.name}", rank * i + o * rank, g.count, expert=g.expert,
                               indexer=g.indexer))
    return out

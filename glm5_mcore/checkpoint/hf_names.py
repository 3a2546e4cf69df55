"""The one HF ↔ Megatron name table for GLM-5, plus the fused-tensor rules.

Megatron names are those of ``GPTModel`` built from ``glm5_mcore.model.layer_spec``; HF names are the
on-disk layout of the release (per-expert ``experts.{e}.{gate,up,down}_proj``). ``{i}`` is the decoder
layer, ``{e}`` the global expert index. The MTP layer ``mtp.layers.{m}`` maps to
``model.layers.{num_hidden_layers + m}``: its own four tensors below, and every decoder-layer row under
``mtp.layers.{m}.mtp_model_layer.``.

Routed experts have two Megatron layouts: ``SequentialMLP``'s ``mlp.experts.local_experts.{e}.linear_fc1.weight``
(the rows below) and, under ``moe_grouped_gemm``, ``TEGroupedMLP``'s ``mlp.experts.linear_fc1.weight{e}`` (one
grouped linear, a parameter per local expert), read as the former (``sequential_name``).

Rules with two HF names are gated MLPs: Megatron's ``linear_fc1`` is ``cat[gate_proj; up_proj]`` on
dim 0 (and each TP shard is ``cat[gate_shard; up_shard]``, see ``shard_for_rank``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

# (Megatron suffix, HF suffix or (gate, up)) within one decoder layer.
LAYER_RULES: list[tuple[str, str | tuple[str, str]]] = [
    ("input_layernorm.weight", "input_layernorm.weight"),
    ("self_attention.linear_q_down_proj.weight", "self_attn.q_a_proj.weight"),
    ("self_attention.q_layernorm.weight", "self_attn.q_a_layernorm.weight"),
    ("self_attention.linear_q_up_proj.weight", "self_attn.q_b_proj.weight"),
    ("self_attention.linear_kv_down_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"),
    ("self_attention.kv_layernorm.weight", "self_attn.kv_a_layernorm.weight"),
    ("self_attention.linear_kv_up_proj.weight", "self_attn.kv_b_proj.weight"),
    ("self_attention.linear_proj.weight", "self_attn.o_proj.weight"),
    ("self_attention.core_attention.indexer.linear_wq_b.weight", "self_attn.indexer.wq_b.weight"),
    ("self_attention.core_attention.indexer.linear_wk.weight", "self_attn.indexer.wk.weight"),
    ("self_attention.core_attention.indexer.k_norm.weight", "self_attn.indexer.k_norm.weight"),
    ("self_attention.core_attention.indexer.k_norm.bias", "self_attn.indexer.k_norm.bias"),
    ("self_attention.core_attention.indexer.linear_weights_proj.weight", "self_attn.indexer.weights_proj.weight"),
    ("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
    ("mlp.linear_fc1.weight", ("mlp.gate_proj.weight", "mlp.up_proj.weight")),
    ("mlp.linear_fc2.weight", "mlp.down_proj.weight"),
    ("mlp.router.weight", "mlp.gate.weight"),
    ("mlp.router.expert_bias", "mlp.gate.e_score_correction_bias"),
    ("mlp.shared_experts.linear_fc1.weight", ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight")),
    ("mlp.shared_experts.linear_fc2.weight", "mlp.shared_experts.down_proj.weight"),
    ("mlp.experts.local_experts.{e}.linear_fc1.weight", ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight")),
    ("mlp.experts.local_experts.{e}.linear_fc2.weight", "mlp.experts.{e}.down_proj.weight"),
]

GLOBAL_RULES: list[tuple[str, str]] = [
    ("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
    ("output_layer.weight", "lm_head.weight"),
    ("decoder.final_layernorm.weight", "model.norm.weight"),
]

MTP_RULES: list[tuple[str, str]] = [
    ("enorm.weight", "enorm.weight"),
    ("hnorm.weight", "hnorm.weight"),
    ("eh_proj.weight", "eh_proj.weight"),
    ("final_layernorm.weight", "shared_head.norm.weight"),
]

# HF tensors kept in fp32 whatever the checkpoint dtype (transformers' _keep_in_fp32_modules_strict).
FP32_HF_SUFFIXES = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_MTP = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
_EXPERT = re.compile(r"local_experts\.(\d+)\.")
_GROUPED = re.compile(r"(^|\.)mlp\.experts\.(linear_fc[12])\.weight(\d+)$")


def sequential_name(name: str) -> str:
    """A ``TEGroupedMLP`` expert weight's name as ``SequentialMLP`` spells it (other names unchanged):
    ``...mlp.experts.linear_fc1.weight3`` -> ``...mlp.experts.local_experts.3.linear_fc1.weight``."""
    return _GROUPED.sub(lambda m: f"{m.group(1)}mlp.experts.local_experts.{m.group(3)}.{m.group(2)}.weight", name)


@dataclass(frozen=True)
class HFSource:
    """Where a (full, unsharded) Megatron tensor comes from in the HF checkpoint."""

    names: tuple[str, ...]
    """One HF name, or (gate, up) to concatenate on dim 0."""

    @property
    def is_glu(self) -> bool:
        return len(self.names) == 2


def _layer_rule(suffix: str, hf_prefix: str, expert_offset: int) -> HFSource | None:
    m = _EXPERT.search(suffix)
    local_e = int(m.group(1)) if m else None
    key = _EXPERT.sub("local_experts.{e}.", suffix) if m else suffix
    for mcore, hf in LAYER_RULES:
        if mcore == key:
            hfs = (hf,) if isinstance(hf, str) else hf
            if local_e is not None:
                hfs = tuple(h.replace("{e}", str(local_e + expert_offset)) for h in hfs)
            return HFSource(tuple(hf_prefix + h for h in hfs))
    return None


def hf_source(mcore_name: str, num_hidden_layers: int, layer_offset: int = 0,
              expert_offset: int = 0) -> HFSource:
    """HF tensor name(s) for a Megatron state-dict name on this rank.

    ``layer_offset`` is this pipeline stage's first decoder layer, ``expert_offset`` this EP rank's
    first global expert. Raises ``KeyError`` for a name the table does not know.
    """
    asked, mcore_name = mcore_name, sequential_name(mcore_name)
    for mcore, hf in GLOBAL_RULES:
        if mcore_name == mcore:
            return HFSource((hf,))
    m = _LAYER.match(mcore_name)
    if m:
        i = int(m.group(1)) + layer_offset
        src = _layer_rule(m.group(2), f"model.layers.{i}.", expert_offset)
        if src:
            return src
    m = _MTP.match(mcore_name)
    if m:
        layer = num_hidden_layers + int(m.group(1))
        rest = m.group(2)
        for mcore, hf in MTP_RULES:
            if rest == mcore:
                return HFSource((f"model.layers.{layer}.{hf}",))
        for inner in ("mtp_model_layer.", "transformer_layer."):
            if rest.startswith(inner):
                src = _layer_rule(rest[len(inner):], f"model.layers.{layer}.", expert_offset)
                if src:
                    return src
    raise KeyError(f"{asked}: not in the GLM-5 HF↔Megatron name table")


def tp_slice(full: torch.Tensor, dim: int, tp_rank: int, tp_size: int, is_glu: bool) -> torch.Tensor:
    """Rank ``tp_rank``'s chunk of ``full`` along ``dim``; a gated fc1 split on dim 0 gives
    ``cat[gate_shard; up_shard]``, as Megatron lays it out."""
    if tp_size == 1:
        return full
    if is_glu and dim == 0:
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(tp_size, 0)[tp_rank], up.chunk(tp_size, 0)[tp_rank]], dim=0)
    return full.chunk(tp_size, dim=dim)[tp_rank]


def shard_for_rank(full: torch.Tensor, param: torch.Tensor, tp_rank: int, tp_size: int,
                   is_glu: bool) -> torch.Tensor:
    """Slice a full tensor to this rank's shard using Megatron's own partition attributes."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    return tp_slice(full, param.partition_dim, tp_rank, tp_size, is_glu)

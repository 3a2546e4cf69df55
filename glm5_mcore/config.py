"""GLM-5 architecture facts, read from an HF ``config.json`` and turned into Megatron-Core's config.

``GLM5Config`` mirrors every field of transformers' ``GlmMoeDsaConfig`` (plus the extra keys the
real release ships: ``num_nextn_predict_layers``, ``indexer_rope_interleave``, ``index_topk_freq``,
``index_skip_topk_offset`` / ``index_topk_pattern``) with HF's semantics. ``to_mcore_config`` maps it
onto ``MLATransformerConfig`` with the GLM-5 details Megatron-Core does not default to: sigmoid
routing with a frozen ``e_score_correction_bias`` as expert bias, routed scaling, interleaved
indexer RoPE without Hadamard rotation, LayerNorm k_norm eps 1e-6, rope theta from the config.
The q_a / kv_a RMSNorm eps (1e-6 in HF, unlike ``rms_norm_eps``) is carried as ``qk_norm_eps`` and
applied by the layer spec, since Megatron-Core uses ``layernorm_epsilon`` for every norm.
The parallel layout, recompute and the indexer-loss hook ``to_mcore_config`` takes are in
``glm5_mcore.mcore_settings``.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from glm5_mcore.mcore_settings import ParallelConfig, dsa_loss_scale

MODEL_TYPE = "glm_moe_dsa"
@dataclass
class GLM5Config:
    """The GLM-5 architecture. Defaults are the released GLM-5 / GLM-5.1 (744B) model."""

    vocab_size: int = 154880
    hidden_size: int = 6144
    intermediate_size: int = 12288
    """Width of the dense SwiGLU MLP of the first ``first_k_dense_replace`` layers."""
    moe_intermediate_size: int = 2048
    """Width of each routed expert; the shared expert is ``moe_intermediate_size * n_shared_experts``."""
    num_hidden_layers: int = 78
    """Decoder layers, excluding the MTP layers (stored as ``model.layers.{num_hidden_layers}.*``)."""
    num_attention_heads: int = 64
    num_key_value_heads: int = 64
    n_shared_experts: int = 1
    n_routed_experts: int = 256
    routed_scaling_factor: float = 2.5
    kv_lora_rank: int = 512
    q_lora_rank: int = 2048
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    qk_nope_head_dim: int = 192
    n_group: int = 1
    topk_group: int = 1
    num_experts_per_tok: int = 8
    norm_topk_prob: bool = True
    hidden_act: str = "silu"
    max_position_embeddings: int = 202752
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-5
    """Eps of input/post-attention/final norms. The q_a/kv_a norms use ``qk_norm_eps``."""
    qk_norm_eps: float = 1e-6
    """HF builds q_a_layernorm / kv_a_layernorm without eps, i.e. with RMSNorm's default 1e-6."""
    indexer_k_norm_eps: float = 1e-6
    pad_token_id: int | None = None
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    tie_word_embeddings: bool = False
    rope_theta: float = 1e6
    """GLM-5 uses 1e6; HF's code default is 1e4, so a config.json must state it."""
    rope_type: str = "default"
    mlp_layer_types: list[str] | None = None
    """Per layer "dense" or "sparse"; derived from ``first_k_dense_replace`` when None."""
    attention_bias: bool = False
    attention_dropout: float = 0.0
    index_topk: int = 2048
    index_head_dim: int = 128
    index_n_heads: int = 32
    mlp_bias: bool = False
    first_k_dense_replace: int = 3
    indexer_types: list[str] | None = None
    """Per layer "full" (own indexer) or "shared" (reuses the previous full layer's top-k)."""
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 2
    index_topk_pattern: str | list[str] | None = None
    num_nextn_predict_layers: int = 0
    indexer_rope_interleave: bool = True
    rope_interleave: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    model_type: str = MODEL_TYPE
    torch_dtype: str = "bfloat16"
    extra: dict[str, Any] = field(default_factory=dict)
    """config.json keys this class does not model (kept so a round trip writes them back)."""

    def __post_init__(self) -> None:
        if self.mlp_layer_types is None:
            n_dense = min(self.first_k_dense_replace, self.num_hidden_layers)
            self.mlp_layer_types = ["dense"] * n_dense + ["sparse"] * (self.num_hidden_layers - n_dense)
        if self.indexer_types is None:
            if self.index_topk_pattern is not None:
                pattern = self.index_topk_pattern
                if isinstance(pattern, str):
                    bad = set(pattern) - {"F", "S"}
                    if bad:
                        raise ValueError(f"index_topk_pattern: only 'F' and 'S' allowed, got {sorted(bad)}")
                    pattern = [{"F": "full", "S": "shared"}[c] for c in pattern]
                self.indexer_types = list(pattern)
            else:
                freq, offset = max(self.index_topk_freq, 1), self.index_skip_topk_offset
                self.indexer_types = [
                    "full" if max(i - offset + 1, 0) % freq == 0 else "shared"
                    for i in range(self.num_hidden_layers)
                ]
        self.validate()

    # ------------------------------------------------------------------ derived facts
    @property
    def qk_head_dim(self) -> int:
        """HF's qk_head_dim (nope + rope). Megatron's ``qk_head_dim`` means nope only."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def moe_layer_pattern(self) -> list[int]:
        return [1 if t == "sparse" else 0 for t in self.mlp_layer_types]

    @property
    def shared_expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.n_shared_experts

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field for anything the model cannot express."""
        if self.model_type != MODEL_TYPE:
            raise ValueError(f"model_type: expected {MODEL_TYPE!r}, got {self.model_type!r}")
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                     "index_head_dim", "index_n_heads", "n_routed_experts", "num_experts_per_tok",
                     "moe_intermediate_size", "intermediate_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}: must be a positive integer, got {getattr(self, name)!r}")
        if self.q_lora_rank is None or self.q_lora_rank < 1:
            raise ValueError("q_lora_rank: GLM-5's indexer consumes the q latent, so it must be set")
        if self.index_topk < 1:
            raise ValueError(f"index_topk: must be >= 1, got {self.index_topk}")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError("num_key_value_heads: MLA needs it equal to num_attention_heads")
        if self.qk_rope_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError("qk_rope_head_dim: must be even and <= index_head_dim")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act: only 'silu' is supported, got {self.hidden_act!r}")
        if self.scoring_func != "sigmoid":
            raise ValueError(f"scoring_func: GLM-5 routes with 'sigmoid', got {self.scoring_func!r}")
        if self.rope_type != "default":
            raise ValueError(f"rope_parameters.rope_type: only 'default' is supported, got {self.rope_type!r}")
        if not self.indexer_rope_interleave:
            raise ValueError("indexer_rope_interleave: transformers >= 5.13 and GLM-5 use interleaved RoPE")
        if self.attention_bias:
            raise ValueError("attention_bias: biases on q_a/kv_a/o_proj are not supported")
        if self.mlp_bias:
            raise ValueError("mlp_bias: GLM-5 MLPs have no bias")
        if not self.norm_topk_prob and self.num_experts_per_tok > 1:
            raise ValueError("norm_topk_prob: Megatron-Core always normalises sigmoid top-k weights")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ValueError("num_experts_per_tok: larger than n_routed_experts")
        if self.n_routed_experts % self.n_group:
            raise ValueError("n_group: must divide n_routed_experts")
        if self.n_group > 1 and self.num_experts_per_tok // self.topk_group != 2:
            raise ValueError("topk_group: group scores are the sum of each group's top-2 in HF; "
                             "Megatron-Core uses top-(num_experts_per_tok/topk_group), so it must be 2")
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            raise ValueError("mlp_layer_types: length must equal num_hidden_layers")
        if set(self.mlp_layer_types) - {"dense", "sparse"}:
            raise ValueError("mlp_layer_types: entries must be 'dense' or 'sparse'")
        if len(self.indexer_types) != self.num_hidden_layers:
            raise ValueError("indexer_types: length must equal num_hidden_layers")
        if set(self.indexer_types) - {"full", "shared"}:
            raise ValueError("indexer_types: entries must be 'full' or 'shared'")
        if self.indexer_types and self.indexer_types[0] == "shared":
            raise ValueError("indexer_types: layer 0 has no earlier layer to share top-k with")
        if self.num_nextn_predict_layers < 0:
            raise ValueError("num_nextn_predict_layers: must be >= 0")
        if self.tie_word_embeddings:
            raise ValueError("tie_word_embeddings: GLM-5 has an untied lm_head")

    # ------------------------------------------------------------------ HF config.json I/O
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> "GLM5Config":
        """Read an HF config dict with GlmMoeDsaConfig's semantics; errors name ``source``."""
        d = dict(d)
        if d.get("model_type") != MODEL_TYPE:
            raise ValueError(f"{source}: model_type must be {MODEL_TYPE!r}, got {d.get('model_type')!r}")
        known = {f.name for f in dataclasses.fields(cls)} - {"extra", "rope_theta", "rope_type"}
        kwargs: dict[str, Any] = {}
        rope = d.pop("rope_parameters", None) or {}
        theta = rope.get("rope_theta", d.pop("rope_theta", None))
        if theta is None:
            warnings.warn(f"{source}: no rope_theta; HF falls back to 10000 (GLM-5 uses 1e6)")
            theta = 10000.0
        kwargs["rope_theta"] = float(theta)
        kwargs["rope_type"] = rope.get("rope_type", "default")
        if d.get("num_experts") is not None:
            d["n_routed_experts"] = d.pop("num_experts")
        if "num_local_experts" in d:
            d["n_routed_experts"] = d.pop("num_local_experts")
        if "dtype" in d and "torch_dtype" not in d:
            d["torch_dtype"] = d.pop("dtype")
        extra = {}
        for k, v in d.items():
            (kwargs if k in known else extra)[k] = v
        for k in ("head_dim", "qk_head_dim", "layer_types"):
            extra.pop(k, None)
        try:
            return cls(**kwargs, extra=extra)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{source}: {e}") from None

    @classmethod
    def from_hf_dir(cls, hf_dir: str | Path) -> "GLM5Config":
        path = Path(hf_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no config.json in the HF checkpoint folder")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        return cls.from_hf_dict(d, source=str(path))

    def to_hf_dict(self) -> dict[str, Any]:
        """The config.json GLM-5 ships (HF fields plus the extras vLLM/Megatron-Bridge read)."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("extra", "rope_theta", "rope_type", "qk_norm_eps", "indexer_k_norm_eps",
                               "index_topk_pattern", "torch_dtype")}
        d["architectures"] = ["GlmMoeDsaForCausalLM"]
        d["rope_parameters"] = {"rope_type": self.rope_type, "rope_theta": self.rope_theta}
        d["dtype"] = self.torch_dtype
        d["head_dim"] = self.qk_rope_head_dim
        d["qk_head_dim"] = self.qk_head_dim
        d.update(self.extra)
        return d

    # ------------------------------------------------------------------ Megatron-Core
    def to_mcore_config(self, parallel: ParallelConfig | None = None, **overrides: Any):
        """Build the ``MLATransformerConfig`` that makes a Megatron-Core GPTModel compute GLM-5."""
        import torch
        import torch.nn.functional as F
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        p = parallel or ParallelConfig()
        p.validate(self)
        kw: dict[str, Any] = dict(
            num_layers=self.num_hidden_layers,
            hidden_size=self.hidden_size,
            ffn_hidden_size=self.intermediate_size,
            num_attention_heads=self.num_attention_heads,
            init_method_std=self.initializer_range,
            normalization="RMSNorm",
            layernorm_epsilon=self.rms_norm_eps,
            add_bias_linear=False,
            gated_linear_unit=True,
            activation_func=F.silu,
            hidden_dropout=0.0,
            attention_dropout=self.attention_dropout,
            # MLA
            multi_latent_attention=True,
            q_lora_rank=self.q_lora_rank,
            kv_lora_rank=self.kv_lora_rank,
            qk_head_dim=self.qk_nope_head_dim,
            qk_pos_emb_head_dim=self.qk_rope_head_dim,
            v_head_dim=self.v_head_dim,
            qk_layernorm=True,
            rope_type="rope",
            rotary_base=self.rope_theta,
            rotary_percent=1.0,
            rotary_scaling_factor=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
            # DSA indexer (field names are Megatron-Core's; the core is glm5_mcore.model.dsa)
            dsa_indexer_n_heads=self.index_n_heads,
            dsa_indexer_head_dim=self.index_head_dim,
            dsa_indexer_topk=self.index_topk,
            dsa_indexer_rope_interleaved=True,
            dsa_indexer_rotate_activation=False,
            dsa_indexer_scoring_relu=True,
            dsa_indexer_k_norm_epsilon=self.indexer_k_norm_eps,
            dsa_indexer_loss_coeff=0.0,  # > 0: the sparse-stage indexer loss (glm5_mcore.model.dsa)
            dsa_indexer_use_sparse_loss=True,
            # Megatron's schedule scales the indexer loss's backward like the main loss (grad scaler, CP)
            experimental_attention_variant_loss_scale_func=dsa_loss_scale,
            # MoE
            num_moe_experts=self.n_routed_experts,
            moe_layer_freq=self.moe_layer_pattern,
            moe_ffn_hidden_size=self.moe_intermediate_size,
            moe_shared_expert_intermediate_size=(
                self.shared_expert_intermediate_size if self.n_shared_experts else None),
            moe_router_topk=self.num_experts_per_tok,
            moe_router_score_function="sigmoid",
            moe_router_enable_expert_bias=True,
            moe_router_bias_update_rate=0.0,
            moe_router_topk_scaling_factor=self.routed_scaling_factor,
            moe_router_num_groups=self.n_group if self.n_group > 1 else None,
            moe_router_group_topk=self.topk_group if self.n_group > 1 else None,
            moe_router_dtype="fp32",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_token_dispatcher_type=p.dispatcher,
            moe_grouped_gemm=False,
            # MTP
            mtp_num_layers=self.num_nextn_predict_layers or None,
            mtp_loss_scaling_factor=0.1,
            # parallel layout
            tensor_model_parallel_size=p.tp,
            expert_model_parallel_size=p.ep,
            expert_tensor_parallel_size=p.etp,
            context_parallel_size=p.cp,
            pipeline_model_parallel_size=p.pp,
            sequence_parallel=p.tp > 1,
            cp_comm_type="allgather" if p.cp > 1 else None,
            params_dtype=torch.float32,
            bf16=False,
        )
        if p.pp > 1:
            kw.update(pipeline_dtype=overrides.get("params_dtype", torch.float32))
        kw.update(overrides)
        if kw.get("moe_router_bias_update_rate", 0.0) > 0:
            warnings.warn("moe_router_bias_update_rate > 0: e_score_correction_bias will drift during "
                          "fine-tuning; HF and the released model keep it fixed")
        cfg = MLATransformerConfig(**kw)
        cfg.glm5 = self  # the layer spec reads qk_norm_eps / indexer_types from here
        return cfg


def glm5_744b() -> GLM5Config:
    """The released GLM-5 / GLM-5.1 architecture (743.9B parameters, MTP layer 78)."""
    return GLM5Config(num_nextn_predict_layers=1, rope_theta=1e6, pad_token_id=154820,
                      eos_token_id=[154820, 154827, 154829])


def glm5_tiny(*, mtp: bool = False, index_share: bool | str = False, vocab_size: int = 128) -> GLM5Config:
    """A debug GLM-5: 4 layers (1 dense + 3 MoE), every GLM-5 feature, ~0.5M parameters.

    Sizes follow ``shared/notes/glm5-reference.md`` section 4.1; 16 indexer heads make exact ReLU ties (all heads <= 0) rare.
    ``index_share`` makes layer 2 reuse layer 1's top-k (pattern FFSF); a string is the F/S pattern itself
    (``"FSFS"``: each stage of PP 2 starts with a full layer and holds a sharer). An odd ``vocab_size`` (129) is
    one TP 2 does not divide (the vocabulary padding, ``glm5_mcore.model.vocab``).
    """
    return GLM5Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16, index_topk=8, index_head_dim=16,
        index_n_heads=16, first_k_dense_replace=1, max_position_embeddings=512,
        num_nextn_predict_layers=1 if mtp else 0, rope_theta=1e6, eos_token_id=1, bos_token_id=0,
        pad_token_id=2, index_topk_pattern=("FFSF" if index_share is True else index_share) or None, torch_dtype="float32",
    )


def warn_if_dsa_inactive(model: GLM5Config, seq_len: int) -> None:
    """index_topk >= seq_len makes DSA select every causal key: plain dense attention."""
    if model.index_topk >= seq_len:
        warnings.warn(f"index_topk={model.index_topk} >= sequence length {seq_len}: DSA selects every "
                      "key and does nothing")

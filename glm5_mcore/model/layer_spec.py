"""GLM-5 layer specs: Megatron-Core ``ModuleSpec`` trees for the decoder block and the MTP block.

Every layer is ``TransformerLayer(MLASelfAttention(core_attention=GLM5SparseAttention(DSAIndexer)),
MLP | MoELayer)``: dense MLP for ``mlp_layer_types == "dense"``, MoE (routed experts + shared
expert) otherwise. "shared" IndexShare layers get a core attention without an indexer. The MTP layer
is a full DSA + MoE layer. One function serves both backends: ``"local"`` (Megatron-Core modules,
runs on CPU) and ``"te"`` (Transformer Engine, GPU).

Under Transformer Engine's FP8 (the FP8 base, ``model.base_dtype=fp8``) every TE linear holds and computes FP8,
so the two linears the release keeps in bf16, the indexer's ``linear_weights_proj`` and the MTP ``eh_proj``, are
Megatron-Core's own linears there, in the trainer's dtype (``quantized_te``).

The q_a / kv_a RMSNorms carry GLM-5's own eps (``GLM5Config.qk_norm_eps``, 1e-6) because
Megatron-Core passes ``layernorm_epsilon`` (1e-5, the decoder norms' eps) to every norm it builds.
"""

from __future__ import annotations

from typing import Optional

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.backends import BackendSpecProvider
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_mtp_block_spec_for_backend,
    get_mlp_module_spec_for_backend,
)
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.experimental_attention_variant.dsa import (
    DSAIndexer,
    DSAIndexerSubmodules,
    DSAttentionSubmodules,
)
from megatron.core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import (
    TransformerLayer,
    TransformerLayerSubmodules,
    get_transformer_layer_offset,
)

from glm5_mcore import cpu_compat
from glm5_mcore.model.dsa import GLM5SparseAttention

BACKENDS = ("local", "te")


def get_backend(name: str) -> BackendSpecProvider:
    """``"local"``: Megatron-Core's own modules (CPU-capable); ``"te"``: Transformer Engine."""
    if name == "local":
        return cpu_compat.LocalBackend()
    if name == "te":
        from megatron.core.extensions.transformer_engine_spec_provider import TESpecProvider

        return TESpecProvider()
    raise ValueError(f"backend: expected one of {BACKENDS}, got {name!r}")


def fixed_eps_norm(norm_builder, eps: float):
    """A norm builder that ignores the eps Megatron-Core passes and uses ``eps``."""

    class FixedEpsNorm:
        def __new__(cls, *, config, hidden_size, eps_from_caller=None, **kwargs):
            kwargs.pop("eps", None)
            return norm_builder(config=config, hidden_size=hidden_size, eps=eps, **kwargs)

    FixedEpsNorm.__name__ = f"FixedEps{getattr(norm_builder, '__name__', 'Norm')}"
    return FixedEpsNorm


def _down_proj(backend: BackendSpecProvider) -> type:
    """q/kv down projections: replicated, as ``TELinear`` with TE and as Megatron-Core's replicated
    ``Linear`` on the local backend (see ``cpu_compat.mla_replicated_down_proj`` for why not
    column-parallel)."""
    if isinstance(backend, cpu_compat.LocalBackend):
        return cpu_compat.mla_replicated_down_proj()
    return backend.linear()


def quantized_te(config, backend: BackendSpecProvider) -> bool:
    """Whether ``backend``'s linears compute in FP8 / FP4: Transformer Engine under ``config.fp8`` (the FP8 base,
    ``model.base_dtype=fp8``), whose ``fp8_param`` builds whole layers under ``fp8_model_init`` (Megatron-Core
    ``transformer_block.py:342-347``, ``multi_token_prediction.py:1708-1716``) and runs them under ``fp8_autocast``."""
    return not isinstance(backend, cpu_compat.LocalBackend) and bool(config.fp8 or getattr(config, "fp4", None))


def _unquantized_linear(config, backend: BackendSpecProvider) -> type:
    """The indexer's ``linear_weights_proj``: a replicated linear in the trainer's dtype. The release stores it in
    bf16 and vLLM serves it so; it decides the top-k, so an FP8 copy would select other keys than the engine. Under
    TE's FP8 it is Megatron-Core's own replicated ``Linear`` (``cpu_compat.LocalBackend.linear``), which neither
    ``fp8_model_init`` nor ``fp8_autocast`` touches."""
    return cpu_compat.LocalBackend().linear() if quantized_te(config, backend) else backend.linear()


def get_glm5_attention_spec(config, backend: BackendSpecProvider, computes_topk: bool = True) -> ModuleSpec:
    """MLA self-attention with GLM-5's DSA core. ``computes_topk=False``: an IndexShare layer."""
    qk_norm = fixed_eps_norm(backend.layer_norm(rms_norm=True, for_qk=True), config.glm5.qk_norm_eps)
    indexer = ModuleSpec(
        module=DSAIndexer,
        submodules=DSAIndexerSubmodules(
            linear_wq_b=backend.linear(),
            linear_wk=backend.linear(),
            k_norm=backend.layer_norm(rms_norm=False, for_qk=True),
            linear_weights_proj=_unquantized_linear(config, backend),
        ),
    )
    return ModuleSpec(
        module=MLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=backend.column_parallel_linear(),
            linear_q_down_proj=_down_proj(backend),
            linear_q_up_proj=backend.column_parallel_linear(),
            linear_kv_down_proj=_down_proj(backend),
            linear_kv_up_proj=backend.column_parallel_linear(),
            core_attention=ModuleSpec(
                module=GLM5SparseAttention,
                params={"computes_topk": computes_topk},
                submodules=DSAttentionSubmodules(indexer=indexer),
            ),
            linear_proj=backend.row_parallel_linear(),
            q_layernorm=qk_norm,
            kv_layernorm=qk_norm,
        ),
    )


def get_glm5_layer_spec(config, backend: BackendSpecProvider, moe: bool, computes_topk: bool = True) -> ModuleSpec:
    """One GLM-5 decoder layer: pre-norm MLA+DSA, then pre-norm dense MLP or MoE."""
    norm = backend.layer_norm(rms_norm=True, for_qk=False)
    mlp = get_mlp_module_spec_for_backend(
        backend=backend, num_experts=config.num_moe_experts if moe else None,
        moe_grouped_gemm=config.moe_grouped_gemm)
    if not moe and backend.fuse_layernorm_and_linear():
        mlp = get_mlp_module_spec_for_backend(backend=_BackendView(backend, fuse_layernorm_and_linear=False),
                                              num_experts=None)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm,
            self_attention=get_glm5_attention_spec(config, backend, computes_topk),
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


class _BackendView:
    """``backend`` with some of its methods answering otherwise (``answers``: method name -> what it returns):
    ``fuse_layernorm_and_linear=False`` keeps norms separate from linears, so HF's post_attention_layernorm maps to
    ``pre_mlp_layernorm`` on every layer and both backends share one state-dict layout; under TE's FP8,
    ``column_parallel_linear=ColumnParallelLinear`` makes the MTP ``eh_proj`` (the only linear
    ``get_mtp_layer_spec_for_backend`` takes from it) Megatron-Core's own, in the trainer's dtype, as the release
    stores it and vLLM serves it."""

    def __init__(self, backend, **answers):
        self._b, self._answers = backend, answers

    def __getattr__(self, name):
        if name in self._answers:
            return lambda *_, **__: self._answers[name]
        return getattr(self._b, name)


def get_glm5_layer_specs(config, backend: str | BackendSpecProvider = "local") -> list[ModuleSpec]:
    """Per-layer specs for all ``num_layers`` decoder layers (before pipeline slicing)."""
    b = get_backend(backend) if isinstance(backend, str) else backend
    glm5 = config.glm5
    return [
        get_glm5_layer_spec(config, b, moe=bool(m), computes_topk=(t == "full"))
        for m, t in zip(glm5.moe_layer_pattern, glm5.indexer_types)
    ]


def get_glm5_decoder_block_spec(config, backend: str = "local", vp_stage: Optional[int] = None,
                                pp_rank: Optional[int] = None) -> TransformerBlockSubmodules:
    """The GLM-5 decoder block for this pipeline stage: dense layers, then MoE layers; final norm."""
    b = get_backend(backend)
    specs = get_glm5_layer_specs(config, b)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    local = specs[offset: offset + n]
    types = config.glm5.indexer_types[offset: offset + n]
    if types and types[0] == "shared":
        raise ValueError(f"pp: pipeline stage starting at layer {offset} begins with an IndexShare layer; "
                         "top-k is not passed across pipeline stages")
    return TransformerBlockSubmodules(layer_specs=local, layer_norm=b.layer_norm(rms_norm=True, for_qk=False))


def get_glm5_mtp_block_spec(config, backend: str = "local", vp_stage: Optional[int] = None,
                            pp_rank: Optional[int] = None):
    """MTP block: ``eh_proj(cat[enorm(emb), hnorm(h)])`` through a full DSA + MoE layer (``eh_proj`` in the
    trainer's dtype under TE's FP8: ``_BackendView``)."""
    if not config.mtp_num_layers:
        return None
    b = get_backend(backend)
    layer = get_glm5_layer_spec(config, b, moe=True, computes_topk=True)
    return get_gpt_mtp_block_spec_for_backend(config=config, spec=layer,
                                              backend=_BackendView(b, column_parallel_linear=ColumnParallelLinear)
                                              if quantized_te(config, b) else b,
                                              vp_stage=vp_stage, pp_rank=pp_rank)

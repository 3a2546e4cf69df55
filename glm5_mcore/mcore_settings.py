"""The Megatron-Core settings of a run that are not GLM-5's architecture (``glm5_mcore.config``):

- ``ParallelConfig``: the model-parallel layout (TP / EP / ETP / CP / PP, the MoE token dispatcher, the
  vocabulary padding), checked against a ``GLM5Config`` by ``GLM5Config.to_mcore_config``;
- ``padded_vocab_size``: the embedding / output-layer rows at a TP (Megatron-LM's ``_vocab_size_with_padding``);
- ``recompute_overrides``: activation recompute as Megatron-Core's recompute fields (SFT and RL);
- ``grouped_gemm``: ``model.moe_grouped_gemm`` resolved for a layer-spec backend;
- ``token_multiple``: what every rank's packed micro-batch is padded to a multiple of (SFT and RL packers);
- ``dsa_loss_scale``: the schedule hook that scales the DSA indexer loss's backward.
"""

from __future__ import annotations

from dataclasses import dataclass

RECOMPUTE_MODES = (None, "selective", "full")


def recompute_overrides(mode) -> dict:
    """Megatron-Core's recompute fields for ``mode`` (SFT ``train.recompute``, RL ``trainer.recompute``): None /
    False: none; ``selective``: the core attention (``recompute_modules=["core_attn"]``); ``full`` / True:
    every layer, uniform, one layer per chunk (a layer keeps only its input)."""
    if mode in (None, False):
        return {}
    if mode == "selective":
        return dict(recompute_granularity="selective", recompute_modules=["core_attn"])
    if mode in (True, "full"):
        return dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    raise ValueError(f"recompute={mode!r}: one of null, selective, full")


def grouped_gemm(setting, backend: str) -> bool:
    """``model.moe_grouped_gemm`` (Megatron-Core's ``moe_grouped_gemm``): None (the default) is on for the TE
    spec, where the routed experts are ``TEGroupedMLP`` (one TE grouped GEMM per layer for all local experts),
    and off for the local spec (``SequentialMLP``: a GEMM per expert). True on the local spec builds
    ``TEGroupedMLP`` over ``cpu_compat.GroupedLinear`` (the grouped layout on the CPU, its GEMMs per expert)."""
    if setting not in (None, True, False):
        raise ValueError(f"model.moe_grouped_gemm={setting!r}: null, true or false")
    return backend == "te" if setting is None else setting


FP8_SHARD_TOKENS = 16
"""Tokens each rank's share of a micro-batch is a multiple of when Transformer Engine computes in FP8 (or FP4):
every FP8 ``Linear`` asserts a multiple of 8 on its (sequence-parallel) input (TE ``module/linear.py``
``assert_dim_for_fp8_exec``, ``utils.py``; the block-scaled cuBLAS GEMM asks the same); 16 as Megatron-Bridge and NeMo
pad packed FP8 batches (16·TP·2·CP)."""


def token_multiple(config) -> int:
    """The token count every rank's packed micro-batch is padded to a multiple of, for a Megatron-Core
    ``TransformerConfig``: ``token_multiple_of`` its TP size, sequence parallelism and FP8 / FP4 under TE
    (``config.fp8``: ``model.base_dtype=fp8`` with the TE backend; the local spec's FP8 base needs nothing). The
    one rule the SFT stream and the RL trainer's packer use."""
    return token_multiple_of(config.tensor_model_parallel_size, config.sequence_parallel,
                             bool(config.fp8 or getattr(config, "fp4", None)))


def token_multiple_of(tp: int, sequence_parallel: bool, fp8: bool) -> int:
    """The TP size under sequence parallelism (each TP rank holds 1/TP of the tokens), times ``FP8_SHARD_TOKENS``
    when TE computes in FP8. Under context parallelism every document is padded to 2·cp times it
    (``data.cp_split``), so each TP shard of each CP rank holds a multiple of 16 tokens (Bridge's 16·TP·2·CP)."""
    return (tp if sequence_parallel else 1) * (FP8_SHARD_TOKENS if fp8 else 1)


@dataclass
class ParallelConfig:
    """Model-parallel layout. TP shards heads and FFNs, EP experts, CP the sequence, ETP each routed
    expert's FFN (Megatron's ``expert_tensor_parallel_size``; etp × ep × pp divides the world)."""

    tp: int = 1
    ep: int = 1
    cp: int = 1
    pp: int = 1
    etp: int = 1
    moe_token_dispatcher_type: str | None = None
    """None: "alltoall" on GPU, "allgather" on CPU (the alltoall dispatcher creates a CUDA stream,
    moe/token_dispatcher.py:469)."""
    make_vocab_size_divisible_by: int = 1
    """Megatron-LM's flag: the embedding and output layer get ``padded_vocab_size`` rows, the vocabulary
    rounded up to a multiple of this × tp (Megatron-LM's default is 128; 1 pads only where tp does not divide
    the vocabulary). The padded logits are -inf (``glm5_mcore.model.vocab``); no HF or PEFT file holds the rows."""

    @property
    def dispatcher(self) -> str:
        if self.moe_token_dispatcher_type:
            return self.moe_token_dispatcher_type
        import torch

        return "alltoall" if torch.cuda.is_available() else "allgather"

    def validate(self, model) -> None:
        """The layout fits ``model`` (a ``glm5_mcore.config.GLM5Config``): heads, vocabulary rows, experts, layers."""
        for name in ("tp", "ep", "cp", "pp", "etp", "make_vocab_size_divisible_by"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        check_model_split(model, tp=self.tp, ep=self.ep, etp=self.etp, pp=self.pp)
        if self.dispatcher not in ("alltoall", "allgather"):
            raise ValueError("moe_token_dispatcher_type: 'alltoall' or 'allgather'")


def check_model_split(model, *, tp: int, ep: int, etp: int, pp: int) -> None:
    """ValueError naming the field where ``model`` (a ``GLM5Config``) does not split over the layout: heads, the
    dense MLP's width and the shared expert's over TP, routed experts over EP, the expert FFN width over ETP,
    layers over PP (the vocabulary rows are padded to a multiple of TP: ``padded_vocab_size``). From the config,
    before any rank builds (Megatron-Core's own ``ensure_divisibility`` asserts inside each rank's MLP build).
    ``ParallelConfig`` (the run) and the planner's ``Layout`` both call it; the message starts with the layout
    field (``tp: ...``), which callers prefix with their section (``parallel.``, ``trainer.``)."""
    if model.num_attention_heads % tp:
        raise ValueError(f"tp: num_attention_heads={model.num_attention_heads} is not divisible by tp={tp}")
    if "dense" in model.mlp_layer_types and model.intermediate_size % tp:
        raise ValueError(f"tp: intermediate_size={model.intermediate_size} (the dense MLP's width, split over TP) "
                         f"is not divisible by tp={tp}")
    if model.n_shared_experts and model.shared_expert_intermediate_size % tp:
        raise ValueError(f"tp: moe_intermediate_size={model.moe_intermediate_size} x n_shared_experts="
                         f"{model.n_shared_experts} (the shared expert's width, split over TP) is not divisible by "
                         f"tp={tp}")
    if model.n_routed_experts % ep:
        raise ValueError(f"ep: n_routed_experts={model.n_routed_experts} is not divisible by ep={ep}")
    if model.moe_intermediate_size % etp:
        raise ValueError(f"etp: moe_intermediate_size={model.moe_intermediate_size} is not divisible by etp={etp}")
    if model.num_hidden_layers % pp:
        raise ValueError(f"pp: num_hidden_layers={model.num_hidden_layers} is not divisible by pp={pp}")


def padded_vocab_size(vocab_size: int, tp: int, divisible_by: int = 1) -> int:
    """Rows of the embedding and output layer for a vocabulary of ``vocab_size`` at tensor parallelism ``tp``:
    rounded up to a multiple of ``divisible_by × tp``, so each TP rank holds an equal share (Megatron-LM's
    ``_vocab_size_with_padding``, ``megatron/training/tokenizer/tokenizer.py``; Megatron-Bridge's
    ``calculate_padded_vocab_size``). 154880 (GLM-5) at tp 8: 154880; 129 at tp 2: 130."""
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def dsa_loss_scale(scale) -> None:
    """Megatron's schedule hook for an attention variant's auxiliary loss: the DSA indexer loss's
    backward scale (``DSAIndexerLossAutoScaler``), as it sets it itself for ``experimental_attention_variant="dsa"``."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

    current = DSAIndexerLossAutoScaler.main_loss_backward_scale
    if current is not None and current.shape != scale.shape:
        # a backward outside the schedule left its default 0-dim scale (dsa.py:1034), which set_loss_scale
        # cannot copy the schedule's [1] scale into (dsa.py:1057, schedules.py:255)
        DSAIndexerLossAutoScaler.main_loss_backward_scale = None
    DSAIndexerLossAutoScaler.set_loss_scale(scale)

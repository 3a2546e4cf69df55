"""The Megatron-Core settings of a run that are not GLM-5's architecture (``glm5_mcore.config``):

- ``ParallelConfig``: the model-parallel layout (TP / EP / ETP / CP / PP, the MoE token dispatcher),
  checked against a ``GLM5Config`` by ``GLM5Config.to_mcore_config``;
- ``recompute_overrides``: activation recompute as Megatron-Core's recompute fields (SFT and RL);
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

    @property
    def dispatcher(self) -> str:
        if self.moe_token_dispatcher_type:
            return self.moe_token_dispatcher_type
        import torch

        return "alltoall" if torch.cuda.is_available() else "allgather"

    def validate(self, model) -> None:
        """The layout fits ``model`` (a ``glm5_mcore.config.GLM5Config``): heads, vocabulary rows, experts, layers."""
        for name in ("tp", "ep", "cp", "pp", "etp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1")
        check_model_split(model, tp=self.tp, ep=self.ep, etp=self.etp, pp=self.pp)
        if self.dispatcher not in ("alltoall", "allgather"):
            raise ValueError("moe_token_dispatcher_type: 'alltoall' or 'allgather'")


def check_model_split(model, *, tp: int, ep: int, etp: int, pp: int) -> None:
    """ValueError naming the field where ``model`` (a ``GLM5Config``) does not split over the layout: heads
    and vocabulary rows over TP, routed experts over EP, the expert FFN width over ETP, layers over PP.
    ``ParallelConfig`` (the run) and the planner's ``Layout`` both call it."""
    if model.num_attention_heads % tp:
        raise ValueError(f"tp: num_attention_heads={model.num_attention_heads} is not divisible by tp={tp}")
    if model.vocab_size % tp:  # Megatron-LM pads it (make_vocab_size_divisible_by); not done here yet
        raise ValueError(f"tp: vocab_size={model.vocab_size} is not divisible by tp={tp} (the output layer "
                         "and embedding are split by vocabulary rows); use a tp that divides it")
    if model.n_routed_experts % ep:
        raise ValueError(f"ep: n_routed_experts={model.n_routed_experts} is not divisible by ep={ep}")
    if model.moe_intermediate_size % etp:
        raise ValueError(f"etp: moe_intermediate_size={model.moe_intermediate_size} is not divisible by etp={etp}")
    if model.num_hidden_layers % pp:
        raise ValueError(f"pp: num_hidden_layers={model.num_hidden_layers} is not divisible by pp={pp}")


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

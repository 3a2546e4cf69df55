"""Build GLM-5 as a Megatron-Core ``GPTModel`` at any TP/EP/CP/PP layout.

``build_model`` builds the decoder and MTP block specs from ``layer_spec`` on the groups
``model.parallel.init_parallel`` made (routed experts grouped or not: ``moe_grouped_gemm``, resolved by
``mcore_settings.grouped_gemm``) and links IndexShare layers; the vocabulary is padded for TP with its
padded logits masked (``model.vocab``); ``forward_logits`` returns full-vocabulary logits gathered over TP;
``packed_seq_params_from_lengths`` is the THD metadata of documents packed back to back. HF weights load
through ``glm5_mcore.checkpoint.hf_load``.
"""

from __future__ import annotations

from typing import Optional

import contextlib

import torch

from glm5_mcore import cpu_compat
from glm5_mcore.config import GLM5Config
from glm5_mcore.mcore_settings import ParallelConfig, grouped_gemm, padded_vocab_size
from glm5_mcore.device import training_device
from glm5_mcore.model.dsa_backend import select as select_dsa_backend
from glm5_mcore.model.dsa import GLM5SparseAttention, link_absorbed_mla, link_index_share
from glm5_mcore.model.fp8_linear import apply_fp8_base
from glm5_mcore.model.fp8_te import (drop_columnwise_after_backward, release_te_copies, te_fp8_build,
                                     te_fp8_overrides)
from glm5_mcore.model.layer_spec import get_glm5_decoder_block_spec, get_glm5_mtp_block_spec
from glm5_mcore.model.vocab import mask_padded_logits, real_vocab_size


def reset_global_trackers() -> None:
    """Megatron-Core keeps MoE aux-loss / MTP / DSA trackers sized by the first model built; clear
    them so several models can live in one process (tests, parity)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    clear_aux_losses_tracker()
    MTPLossLoggingHelper.tracker = {}


def build_model(glm5: GLM5Config, parallel: Optional[ParallelConfig] = None, backend: str = "local",
                pre_process: Optional[bool] = None, post_process: Optional[bool] = None,
                device: Optional[torch.device | str] = None, base_fp8_block: Optional[int] = None,
                **config_overrides):
    """A Megatron-Core ``GPTModel`` computing GLM-5 (this rank's shard: its pipeline stage's layers,
    the embedding on the first stage, output layer and MTP on the last), on ``device``: the training
    device (``glm5_mcore.device``) unless given ("meta" for a shapes-only model, as conversion
    builds). Parallel state must be initialised for ``parallel`` (``init_parallel``). The embedding and
    output layer have ``padded_vocab_size`` rows (``parallel.make_vocab_size_divisible_by`` × tp), the
    padded logits -inf (``model.vocab``).

    ``base_fp8_block``: a frozen FP8 base (``model.base_dtype=fp8``, ``model.fp8_linear``) in
    ``base_fp8_block``-square blocks: the local spec holds ``BlockFP8Weight`` s, TE its blockwise FP8
    primary weights (Megatron-Core ``fp8_recipe="blockwise"``, ``fp8_param``; built without grad and held
    row-wise only outside a module's backward: ``model.fp8_te``); weights come from the load."""
    from megatron.core import parallel_state as ps

    from megatron.core.models.gpt import GPTModel

    cpu_compat.apply()
    parallel = parallel or ParallelConfig()
    config_overrides.setdefault("transformer_impl", "local" if backend == "local" else "transformer_engine")
    te_fp8 = base_fp8_block is not None and backend != "local"
    if te_fp8:
        config_overrides.update(te_fp8_overrides())
    config_overrides.setdefault("expert_tensor_parallel_size", parallel.etp)
    config_overrides["moe_grouped_gemm"] = grouped_gemm(config_overrides.get("moe_grouped_gemm"), backend)
    dsa = config_overrides.pop("dsa_kernel_backend", "auto")
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage() if parallel.pp > 1 else True
    if post_process is None:
        post_process = ps.is_pipeline_last_stage() if parallel.pp > 1 else True
    cfg = select_dsa_backend(dsa, training_device() if device is None else device,
                             lambda b: glm5.to_mcore_config(parallel, dsa_kernel_backend=b, **config_overrides),
                             parallel.tp)
    reset_global_trackers()
    block = get_glm5_decoder_block_spec(cfg, backend)
    mtp = get_glm5_mtp_block_spec(cfg, backend) if post_process else None
    with te_fp8_build() if te_fp8 else contextlib.nullcontext():  # TE's FP8 weights row-wise only (model.fp8_te)
        model = GPTModel(
            config=cfg,
            transformer_layer_spec=block,
            vocab_size=padded_vocab_size(glm5.vocab_size, parallel.tp, parallel.make_vocab_size_divisible_by),
            max_sequence_length=glm5.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            rotary_base=int(glm5.rope_theta),
            mtp_block_spec=mtp,
        )
    link_index_share(m for m in model.decoder.modules() if isinstance(m, GLM5SparseAttention))
    link_absorbed_mla(model)
    keep_router_fp32(model)
    if post_process:
        mask_padded_logits(model, glm5.vocab_size)
    if cfg.recompute_granularity is not None:
        model.decoder.register_forward_pre_hook(_recompute_input_needs_grad, with_kwargs=True)
    # Megatron's get_model moves the model to the current CUDA device before DDP and the optimizer;
    # LoRA adapters, created beside their base weights, follow. Norms, replicated linears and the
    # router are built without a device, on the CPU.
    model = model.to(training_device() if device is None else device)
    if base_fp8_block is not None:
        apply_fp8_base(model, glm5.num_hidden_layers, base_fp8_block)
        release_te_copies(model)
        drop_columnwise_after_backward(model)
    return model


def _recompute_input_needs_grad(_decoder, args, kwargs):
    """The decoder's input ``hidden_states`` [S, b, H] made a leaf that requires grad, under recompute, when
    it carries no graph (a frozen embedding: LoRA, the indexer stages). Megatron's checkpoint
    (tensor_parallel/random.py ``CheckpointFunction``) only runs its backward, and so computes the gradients
    of the adapters or the indexer inside the recomputed region, when one of its input tensors requires grad
    (the same fix as Megatron-Bridge's ``maybe_enable_recompute_inputs_grad``); without it full recompute
    fails (no output requires grad) or leaves those gradients at zero. A no-op without grad (eval, the
    rollout's log-probs) and where the input already requires grad (later pipeline stages, a trained
    embedding)."""
    h = kwargs.get("hidden_states")
    if torch.is_grad_enabled() and torch.is_tensor(h) and h.is_floating_point() and not h.requires_grad:
        kwargs["hidden_states"] = h.detach().requires_grad_()
        return args, kwargs
    return None


def keep_router_fp32(model) -> None:
    """GLM-5's router weight is fp32 in the release and in transformers (``_keep_in_fp32_modules``);
    Megatron-Core casts it to ``params_dtype`` (moe/router.py:81). Keep it fp32 so bf16 checkpoints
    round-trip losslessly (the router computes in fp32 anyway: ``moe_router_dtype="fp32"``)."""
    from megatron.core.transformer.moe.router import TopKRouter

    for m in model.modules():
        if isinstance(m, TopKRouter) and m.weight.dtype != torch.float32:
            m.weight.data = m.weight.data.float()


def packed_seq_params_from_lengths(lengths: list[int], device=None):
    """THD ``PackedSeqParams`` for documents of the given lengths packed back to back."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32, device=device), 0)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


def forward_logits(model, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                   packed_seq_params=None) -> torch.Tensor:
    """Full-vocabulary logits ``[B, S_local, V]`` for this rank's tokens, gathered over TP (the real
    vocabulary: the padding ``build_model`` adds for TP is cut off)."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    B, S = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(S, device=input_ids.device).unsqueeze(0).expand(B, S)
    logits = model(input_ids=input_ids, position_ids=position_ids, attention_mask=None,
                   packed_seq_params=packed_seq_params)
    return gather_from_tensor_model_parallel_region(logits)[..., :real_vocab_size(model)]

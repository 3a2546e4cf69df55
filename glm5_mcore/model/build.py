"""Build GLM-5 as a Megatron-Core ``GPTModel`` and load HF weights into it at any TP/EP/CP layout.

``build_model`` initialises Megatron's parallel state if needed, builds the decoder and MTP block
specs from ``layer_spec`` and links IndexShare layers. ``load_hf_weights`` fills every parameter
and buffer from an HF folder through the one name table (``hf_names``), slicing each tensor to this
rank's shard by Megatron's own partition attributes. ``forward_logits`` returns full-vocabulary
logits gathered over TP (and over CP, in natural token order).
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist

from glm5_mcore import cpu_compat
from glm5_mcore.config import GLM5Config, ParallelConfig
from glm5_mcore.device import training_device
from glm5_mcore.model import dsa_backend
from glm5_mcore.model.dsa import GLM5SparseAttention, link_absorbed_mla, link_index_share


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel(parallel: ParallelConfig, seed: int = 1234) -> None:
    """Start torch.distributed (gloo on CPU, NCCL on GPU; one process without torchrun) and
    Megatron's model-parallel groups for ``parallel``."""
    from megatron.core import parallel_state

    cpu_compat.apply()
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(_free_port())
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(backend=backend)
    world = dist.get_world_size()
    model_ranks = parallel.tp * parallel.cp * parallel.pp
    if world % model_ranks:
        raise ValueError(f"tp*cp*pp={model_ranks} does not divide the world size {world}")
    if world % (parallel.ep * parallel.pp):
        raise ValueError(f"ep*pp={parallel.ep * parallel.pp} does not divide the world size {world}")
    global _LAYOUT
    layout = (world, parallel.tp, parallel.ep, parallel.cp, parallel.pp)
    if parallel_state.model_parallel_is_initialized():
        if layout == _LAYOUT:  # same groups: keep them (re-creating leaks gloo threads)
            _seed(seed)
            return
        _destroy_model_parallel()
    _LAYOUT = layout
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=1,
    )
    _seed(seed)


_LAYOUT: Optional[tuple] = None


def _seed(seed: int) -> None:
    from megatron.core import tensor_parallel

    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:  # tensor_parallel/random.py:303 reads the CUDA RNG; the inference tracker does not
        tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
    torch.manual_seed(seed)


def _destroy_model_parallel() -> None:
    """Megatron's ``destroy_model_parallel`` drops its group handles but leaves the process groups
    (and each gloo group's threads) alive; destroy every sub-group first."""
    from megatron.core import parallel_state

    world = dist.GroupMember.WORLD
    for pg in list(dist.distributed_c10d._world.pg_map):
        if pg is not world:
            dist.destroy_process_group(pg)
    parallel_state.destroy_model_parallel()


def reset_global_trackers() -> None:
    """Megatron-Core keeps MoE aux-loss / MTP / DSA trackers sized by the first model built; clear
    them so several models can live in one process (tests, parity)."""
    from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    clear_aux_losses_tracker()
    MTPLossLoggingHelper.tracker = {}


def build_model(glm5: GLM5Config, parallel: Optional[ParallelConfig] = None, backend: str = "local",
                pre_process: Optional[bool] = None, post_process: Optional[bool] = None,
                device: Optional[torch.device | str] = None, **config_overrides):
    """A Megatron-Core ``GPTModel`` computing GLM-5 (this rank's shard: its pipeline stage's layers,
    the embedding on the first stage, output layer and MTP on the last), on ``device``: the training
    device (``glm5_mcore.device``) unless given ("meta" for a shapes-only model, as conversion
    builds). Parallel state must be initialised for ``parallel`` (``init_parallel``)."""
    from megatron.core import parallel_state as ps

    from megatron.core.models.gpt import GPTModel

    from glm5_mcore.model.layer_spec import get_glm5_decoder_block_spec, get_glm5_mtp_block_spec

    cpu_compat.apply()
    parallel = parallel or ParallelConfig()
    config_overrides.setdefault("transformer_impl", "local" if backend == "local" else "transformer_engine")
    config_overrides.setdefault("expert_tensor_parallel_size", 1)
    config_overrides["dsa_kernel_backend"] = dsa_backend.resolve(config_overrides.get("dsa_kernel_backend", "auto"),
                                                                 training_device() if device is None else device)
    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage() if parallel.pp > 1 else True
    if post_process is None:
        post_process = ps.is_pipeline_last_stage() if parallel.pp > 1 else True
    cfg = glm5.to_mcore_config(parallel, **config_overrides)
    reset_global_trackers()
    block = get_glm5_decoder_block_spec(cfg, backend)
    mtp = get_glm5_mtp_block_spec(cfg, backend) if post_process else None
    model = GPTModel(
        config=cfg,
        transformer_layer_spec=block,
        vocab_size=glm5.vocab_size,
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
    # Megatron's get_model moves the model to the current CUDA device before DDP and the optimizer;
    # LoRA adapters, created beside their base weights, follow. Norms, replicated linears and the
    # router are built without a device, on the CPU.
    return model.to(training_device() if device is None else device)


def keep_router_fp32(model) -> None:
    """GLM-5's router weight is fp32 in the release and in transformers (``_keep_in_fp32_modules``);
    Megatron-Core casts it to ``params_dtype`` (moe/router.py:81). Keep it fp32 so bf16 checkpoints
    round-trip losslessly (the router computes in fp32 anyway: ``moe_router_dtype="fp32"``)."""
    from megatron.core.transformer.moe.router import TopKRouter

    for m in model.modules():
        if isinstance(m, TopKRouter) and m.weight.dtype != torch.float32:
            m.weight.data = m.weight.data.float()


def _rank_offsets(model) -> tuple[int, int, int, int, int, int]:
    from megatron.core import parallel_state as ps

    n_local_experts = model.config.num_moe_experts // ps.get_expert_model_parallel_world_size()
    layer_offset = 0
    if model.decoder.layers:
        layer_offset = model.decoder.layers[0].layer_number - 1
    return (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
            ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
            layer_offset, ps.get_expert_model_parallel_rank() * n_local_experts)


def mcore_to_hf_sources(model, num_hidden_layers: int):
    """Yield ``(megatron_name, tensor, HFSource, tp_rank, tp_size)`` for every param and buffer."""
    from glm5_mcore.checkpoint.hf_names import hf_source

    tp_rank, tp_size, etp_rank, etp_size, layer_offset, expert_offset = _rank_offsets(model)
    for name, t in model.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state") or "local_tokens_per_expert" in name or ".lora." in name:
            continue  # LoRA adapters are not HF base weights
        is_expert = ".experts." in name
        src = hf_source(name, num_hidden_layers, layer_offset, expert_offset if is_expert else 0)
        yield name, t, src, (etp_rank if is_expert else tp_rank), (etp_size if is_expert else tp_size)


@torch.no_grad()
def load_hf_weights(model, hf_dir, glm5: GLM5Config, skip_prefixes: tuple = ()) -> int:
    """Copy every parameter and buffer of this rank from the HF folder. Returns #tensors loaded.
    Megatron names starting with one of ``skip_prefixes`` keep their initialisation (a fresh MTP
    block: ``skip_prefixes=("mtp.",)``).

    Errors name the missing tensor, or the tensor whose shape does not match the model's.
    """
    from glm5_mcore.checkpoint.layout import check_finite
    from glm5_mcore.checkpoint.hf_io import HFCheckpoint
    from glm5_mcore.checkpoint.hf_names import shard_for_rank
    from glm5_mcore.checkpoint.manifest import verify_under

    verify_under(hf_dir)
    ckpt = HFCheckpoint(hf_dir)
    n = 0
    for name, target, src, rank, size in mcore_to_hf_sources(model, glm5.num_hidden_layers):
        if skip_prefixes and name.startswith(skip_prefixes):
            continue
        parts = [ckpt.get(h) for h in src.names]
        if src.is_glu and parts[0].shape != parts[1].shape:
            raise ValueError(f"{hf_dir}: {src.names[0]} {tuple(parts[0].shape)} and {src.names[1]} "
                             f"{tuple(parts[1].shape)} differ")
        full = torch.cat(parts, dim=0) if src.is_glu else parts[0]
        shard = shard_for_rank(full, target, rank, size, src.is_glu)
        if tuple(shard.shape) != tuple(target.shape):
            raise ValueError(f"{hf_dir}: tensor {'+'.join(src.names)} has shape {tuple(full.shape)}, "
                             f"model expects {tuple(target.shape)} for {name} on this rank")
        check_finite(shard, "+".join(src.names), hf_dir)
        target.data.copy_(shard.to(target.dtype))
        n += 1
    return n


def packed_seq_params_from_lengths(lengths: list[int], device=None):
    """THD ``PackedSeqParams`` for documents of the given lengths packed back to back."""
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32, device=device), 0)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                           max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))


def forward_logits(model, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                   packed_seq_params=None) -> torch.Tensor:
    """Full-vocabulary logits ``[B, S_local, V]`` for this rank's tokens, gathered over TP."""
    from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region

    B, S = input_ids.shape
    if position_ids is None:
        position_ids = torch.arange(S, device=input_ids.device).unsqueeze(0).expand(B, S)
    logits = model(input_ids=input_ids, position_ids=position_ids, attention_mask=None,
                   packed_seq_params=packed_seq_params)
    return gather_from_tensor_model_parallel_region(logits)

"""Process groups and RNG of one rank: torch.distributed (gloo on CPU, NCCL on GPU) with Megatron's
TP/EP/CP/PP groups (``init_parallel``), the model-parallel RNG seeding (``seed_parallel``), and where this
rank's layers and experts sit in the whole network (``rank_offsets``)."""

from __future__ import annotations

import os
import socket
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core import tensor_parallel

from glm5_mcore import cpu_compat
from glm5_mcore.mcore_settings import ParallelConfig
from glm5_mcore.device import dist_timeout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel(parallel: ParallelConfig, seed: int = 1234) -> None:
    """Start torch.distributed (gloo on CPU, NCCL on GPU; one process without torchrun) and
    Megatron's model-parallel groups for ``parallel``."""
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
        dist.init_process_group(backend=backend, timeout=dist_timeout())
    world = dist.get_world_size()
    model_ranks = parallel.tp * parallel.cp * parallel.pp
    if world % model_ranks:
        raise ValueError(f"tp*cp*pp={model_ranks} does not divide the world size {world}")
    if world % (parallel.etp * parallel.ep * parallel.pp):
        raise ValueError(f"etp*ep*pp={parallel.etp * parallel.ep * parallel.pp} does not divide the world size {world}")
    global _LAYOUT
    layout = (world, parallel.tp, parallel.ep, parallel.cp, parallel.pp, parallel.etp)
    if ps.model_parallel_is_initialized():
        if layout == _LAYOUT:  # same groups: keep them (re-creating leaks gloo threads)
            seed_parallel(seed)
            return
        _destroy_model_parallel()
    _LAYOUT = layout
    ps.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tp,
        pipeline_model_parallel_size=parallel.pp,
        context_parallel_size=parallel.cp,
        expert_model_parallel_size=parallel.ep,
        expert_tensor_parallel_size=parallel.etp,
        distributed_timeout_minutes=max(1, round(dist_timeout().total_seconds() / 60)),
    )
    seed_parallel(seed)


_LAYOUT: Optional[tuple] = None


def seed_parallel(seed: int) -> None:
    """Megatron's model-parallel RNG tracker and torch's default generator seeded with ``seed``."""
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:  # tensor_parallel/random.py:303 reads the CUDA RNG; the inference tracker does not
        tensor_parallel.model_parallel_cuda_manual_seed(seed, inference_rng_tracker=True)
    torch.manual_seed(seed)


def _destroy_model_parallel() -> None:
    """Megatron's ``destroy_model_parallel`` drops its group handles but leaves the process groups
    (and each gloo group's threads) alive; destroy every sub-group first."""
    world = dist.GroupMember.WORLD
    for pg in list(dist.distributed_c10d._world.pg_map):
        if pg is not world:
            dist.destroy_process_group(pg)
    ps.destroy_model_parallel()


def rank_offsets(model) -> tuple[int, int, int, int, int, int]:
    """(tp rank, tp size, expert-tp rank, expert-tp size, first layer index, first expert index) of this
    rank's shard of ``model``: where its layers and experts sit in the whole network."""
    n_local_experts = model.config.num_moe_experts // ps.get_expert_model_parallel_world_size()
    layer_offset = 0
    if model.decoder.layers:
        layer_offset = model.decoder.layers[0].layer_number - 1
    return (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
            ps.get_expert_tensor_parallel_rank(), ps.get_expert_tensor_parallel_world_size(),
            layer_offset, ps.get_expert_model_parallel_rank() * n_local_experts)


def forget_layout() -> None:
    """Make the next ``init_parallel`` build its groups anew (another backend replaced them: ``plan.fake_rank``)."""
    global _LAYOUT
    _LAYOUT = None

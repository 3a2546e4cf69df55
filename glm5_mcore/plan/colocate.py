"""Colocated RL sized per GPU: the trainer and the rollout engine time-share every GPU (``rl.schedule.colocate``).

Each GPU holds one trainer rank and one engine shard (the engines span the trainer's world: ``engines ×
engine GPUs = world``) and lives through two phases per step; it needs the larger of them:

- **training phase** (the trainer's passes, the engine asleep): the fullest trainer rank's total
  (``planner.RankPlan.total``) + what a sleeping vLLM keeps (``ENGINE_ASLEEP``: its CUDA context and
  the allocator's pools; sleep frees weights and KV cache);
- **push** (one-GPU engines: the weights awake, the KV cache not yet): the trainer's resident bytes + the
  engine's context and weights + the rollout actor's context and one weight-sync bucket (``SYNC_BUCKET``);
- **generation phase** (the engine awake, the trainer offloaded): what vLLM takes,
  ``gpu_memory_utilization`` × the card (engine weights + activation reserve + a KV cache that must hold
  at least one group of ``rollout.n`` sequences of prompt + response tokens over the engine's DP
  replicas), + the engine's CUDA context + what the trainer keeps resident: its weights and buffers, or
  only the adapters and buffers when the frozen base weights are offloaded
  (``rollout.colocate.offload_weights``); gradients, optimizer state and activations are always out.
  ``best_colocated`` picks the largest ``gpu_memory_utilization`` (in 0.05 steps) the phase allows.

The time to move what is offloaded, both ways, at ``PCIE_GBPS`` per GPU: the trainer's gradients are
freed (nothing moves), optimizer state and (if offloaded) frozen weights go out and back; the engine's
weights go out and back at sleep level 1, and at level 2 come back once through the push.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from glm5_mcore.config import GLM5Config
from glm5_mcore.plan.cluster import GIB, Cluster
from glm5_mcore.plan.rollout import ACTIVATION_RESERVE, EnginePlan, EngineSpec, engine_weights, kv_bytes_per_token

ENGINE_ASLEEP = 1 * GIB
"""A sleeping vLLM engine's footprint: CUDA context + cumem allocator pools (weights and KV cache freed)."""
ENGINE_CONTEXT = 1 * GIB
"""The engine process's CUDA context and NCCL buffers while awake (the trainer's are in the cluster reserve)."""
SYNC_BUCKET = 2 << 30
"""A one-GPU colocated engine's weight sync (CUDA IPC, ``rl.rollout.weight_sync``): one bucket of
``VLLMRolloutEngine``'s default ``push_bytes`` on the GPU at a time, freed after each push (a decoder layer larger
than that is a bucket of its own: raise it with ``push_bytes``). Engines over several GPUs push by file (host)."""
SYNC_CONTEXT = GIB // 2
"""The rollout actor's own CUDA context (it builds the buckets on the engine's GPU)."""
PCIE_GBPS = 25.0
"""Host <-> device GB/s per GPU with pinned memory when all GPUs of a node move at once (PCIe Gen5 x16 is
~55 GB/s one way for one GPU; two GPUs share a switch uplink on HGX H100 boards)."""


@dataclass
class PhasePlan:
    """Per GPU bytes of both phases and what moves each step."""
    trainer_total: int
    trainer_weights: int
    trainer_resident: int
    """What the trainer keeps on the GPU while the engine generates."""
    optimizer: int
    grads: int
    engine_weights: int
    kv_group: int
    """KV cache of one group of n sequences on this GPU."""
    engine_share: int
    """What vLLM takes: ``gpu_memory_utilization`` × the card."""
    kv_budget: int
    """vLLM's KV cache: its share less weights and activation reserve (sequences at once = budget / per sequence)."""
    sequences: int
    training: int
    generation: int
    capacity: int
    offload_weights: bool
    sleep_level: int
    move_bytes: int
    """Host <-> device bytes per step (both directions)."""
    push: int = 0
    """The weight sync's moment (one-GPU engines; 0 for engines that push by file)."""

    @property
    def per_gpu(self) -> int:
        return max(self.training, self.generation, self.push)

    @property
    def fits(self) -> bool:
        return self.per_gpu <= self.capacity and self.kv_budget >= self.kv_group

    @property
    def move_seconds(self) -> float:
        return self.move_bytes / (PCIE_GBPS * 1e9)

    def as_dict(self) -> dict:
        g = lambda x: round(x / GIB, 2)  # noqa: E731
        return {"training_phase_gib": g(self.training), "generation_phase_gib": g(self.generation),
                "push_gib": g(self.push),
                "per_gpu_gib": g(self.per_gpu), "capacity_gib": g(self.capacity),
                "trainer_total_gib": g(self.trainer_total), "trainer_resident_gib": g(self.trainer_resident),
                "engine_weights_gib": g(self.engine_weights), "engine_share_gib": g(self.engine_share), "kv_group_gib": g(self.kv_group),
                "kv_budget_gib": g(self.kv_budget), "sequences_at_once": self.sequences,
                "offload_weights": self.offload_weights, "sleep_level": self.sleep_level,
                "offload_gib_per_step": g(self.move_bytes), "offload_s_per_step": round(self.move_seconds, 2),
                "fits": self.fits}


def plan_phases(m: GLM5Config, rank, engine: EngineSpec, cluster: Cluster, n: int, prompt: int, response: int,
                offload_weights: bool, level: int) -> PhasePlan:
    """Both phases of one GPU; ``rank``: the fullest trainer ``planner.RankPlan``."""
    s = rank.state
    pb = s.grads // s.trainable if s.trainable else 2  # adapters in the parameters' dtype, as their grads
    opt = (s.main_params_dist + s.optimizer_dist) if rank.dist_opt else (s.main_params + s.optimizer)
    weights = s.weights + s.buffers
    adapters = s.trainable * pb
    resident = (s.buffers + adapters) if offload_weights else weights
    ew = engine_weights(m, engine)
    per_seq = kv_bytes_per_token(m, engine) * (prompt + response)
    kv_group = per_seq * -(-n // engine.dp)
    cap = cluster.usable_bytes
    share = int(cluster.gpu_mem_gib * GIB * engine.gpu_memory_utilization)  # vLLM takes all of it
    budget = max(0, share - ew - ACTIVATION_RESERVE)
    generation = resident + ENGINE_CONTEXT + share
    training = rank.total + ENGINE_ASLEEP
    moved = 2 * opt + (2 * (s.weights - adapters) if offload_weights else 0) + (2 * ew if level == 1 else ew)
    push = resident + ENGINE_CONTEXT + ew + SYNC_CONTEXT + SYNC_BUCKET if engine.gpus == 1 else 0
    return PhasePlan(trainer_total=rank.total, trainer_weights=weights, trainer_resident=resident, optimizer=opt,
                     grads=s.grads, engine_weights=ew, engine_share=share, kv_group=kv_group, kv_budget=budget,
                     sequences=budget // per_seq * engine.dp, training=training, generation=generation, capacity=cap,
                     offload_weights=offload_weights, sleep_level=level, move_bytes=moved, push=push)


def engine_options(world: int, cluster: Cluster, base: EngineSpec):
    """Engines that tile ``world`` GPUs, fewest GPUs per engine first (more engines generate in parallel): TP
    within a node, pipeline stages across nodes once TP fills one (vLLM's Ray executor over the trainer's bundles:
    ``rl.cluster.engine_placement``; the offline ``LLM`` takes no DP), experts spread over each stage's GPUs, FP8 as
    given or on."""
    sizes = [g for g in (1, 2, 4, 8, 16, 32, 64, 128, 256) if g <= world and world % g == 0]
    for g in sizes:
        for fp8 in sorted({base.fp8, True}):
            for tp in (8, 4, 2, 1):
                if tp > cluster.gpus_per_node or g % tp or (g > tp and tp < min(g, cluster.gpus_per_node)):
                    continue
                yield replace(base, tp=tp, pp=g // tp, dp=1, expert_parallel=True, fp8=fp8)


def best_colocated(m: GLM5Config, rank, world: int, cluster: Cluster, n: int, prompt: int, response: int,
                   base: EngineSpec, level: int) -> Optional[tuple[EngineSpec, PhasePlan]]:
    """The engine tiling ``world`` whose colocated phases fit, moving the fewest bytes per step (frozen
    weights stay resident when they can), then the most sequences at once."""
    best = None
    for e in engine_options(world, cluster, base):
        for off in (False, True):
            p = plan_phases(m, rank, e, cluster, n, prompt, response, off, level)
            util = min(0.9, int(20 * (p.capacity - p.trainer_resident - ENGINE_CONTEXT) / (cluster.gpu_mem_gib * GIB))
                       / 20)
            if util <= 0:
                continue
            e = replace(e, gpu_memory_utilization=util)
            p = plan_phases(m, rank, e, cluster, n, prompt, response, off, level)
            if p.fits:
                key = (p.move_bytes, -p.sequences, e.gpus)
                if best is None or key < best[0]:
                    best = (key, e, p)
                break
    return None if best is None else (best[1], best[2])


def engine_plan_of(m: GLM5Config, p: PhasePlan, e: EngineSpec, n: int) -> EnginePlan:
    """The ``EnginePlan`` view of a colocated engine (the plan's rollout section)."""
    return EnginePlan(e, p.engine_weights, kv_bytes_per_token(m, e), p.kv_budget, p.sequences, n, p.fits,
                      "" if p.fits else f"the generation phase needs {p.generation / GIB:.1f} GiB per GPU")

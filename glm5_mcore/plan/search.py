"""``search_layouts``: the feasible layouts with the fewest GPUs, best first; ``search_rl``: the same for an
RL job over colocated and separate engine placements.

Worlds grow a node at a time; inside one, TP stays within a node (1..GPUs per node) and is tried
first, then EP, ETP, PP, CP (dimensions the job's recipe cannot change stay as they are). A layout is
feasible when every kind of rank fits the card. Best: fewest GPUs, then the least memory on the
fullest rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from glm5_mcore.config import GLM5Config
from glm5_mcore.plan.cluster import GIB, Cluster
from glm5_mcore.plan.colocate import PhasePlan, best_colocated
from glm5_mcore.plan.job import Job
from glm5_mcore.plan.layout import Layout
from glm5_mcore.plan.planner import Plan, plan_job
from glm5_mcore.plan.rollout import ACTIVATION_RESERVE, EngineSpec, smallest_engine


def _divisors(n: int, cap: int) -> list[int]:
    return [d for d in range(1, min(n, cap) + 1) if n % d == 0]


def candidate_layouts(m: GLM5Config, job: Job, world: int, gpus_per_node: int):
    cur = job.layout
    pow2 = [d for d in (1, 2, 4, 8, 16, 32) if d <= gpus_per_node]
    tps = [d for d in pow2 if m.num_attention_heads % d == 0]  # the vocabulary is padded for any tp
    eps = [d for d in _divisors(m.n_routed_experts, m.n_routed_experts) if d & (d - 1) == 0]
    etps = [d for d in pow2 if m.moe_intermediate_size % d == 0]
    pps = _divisors(m.num_hidden_layers, 32)
    cps = [d for d in (1, 2, 4, 8, 16, 32) if job.micro_batch_tokens % (2 * d) == 0]
    fixed = set(job.fixed)
    for tp in reversed(tps):
        for ep in eps:
            for etp in ([cur.etp] if "etp" in fixed else etps):
                for pp in ([cur.pp] if "pp" in fixed else pps):
                    for cp in ([cur.cp] if "cp" in fixed else cps):
                        L = Layout(world, tp, ep, etp, pp, cp, cur.make_vocab_size_divisible_by)
                        if world % (tp * cp * pp) or world % (etp * ep * pp) or etp * ep > world // pp:
                            continue
                        yield L


def search_layouts(m: GLM5Config, job: Job, cluster: Cluster, limit: int = 8, min_world: int = 1) -> list[Plan]:
    """Feasible trainer layouts for ``job``, fewest GPUs first (at most ``limit``); the rollout
    engines and the cluster's size are not part of the search."""
    found: list[Plan] = []
    step = cluster.gpus_per_node
    worlds = [w for w in (1, 2, 4) if w < step] + list(range(step, 64 * step + 1, step))
    big = replace(cluster, nodes=10 ** 6, gpus_per_node=step)
    for world in worlds:
        if world < min_world:
            continue
        for L in candidate_layouts(m, job, world, step):
            trial = replace(job, layout=L, rollout=None)
            try:
                p = plan_job(m, trial, big)
            except ValueError:
                continue
            if p.fits:
                found.append(p)
        if len(found) >= limit:
            break
    found.sort(key=lambda p: (p.job.layout.world, p.worst.total))
    return found[:limit]


@dataclass
class RLLayout:
    """One RL layout: the trainer's, and its engines colocated on the same GPUs or on their own."""
    mode: str
    """``colocated`` or ``separate``."""
    trainer: Plan
    engine: EngineSpec
    engines: int
    gpus: int
    per_gpu: int
    """The fullest GPU: max(training, generation phase) colocated; the fuller of trainer rank and engine
    GPU separate."""
    phases: Optional[PhasePlan] = None

    def as_dict(self) -> dict:
        e = self.engine
        d = {"mode": self.mode, "gpus": self.gpus, "trainer": self.trainer.job.layout.as_dict(),
             "engines": self.engines, "engine": {"tp": e.tp, "dp": e.dp, "pp": e.pp, "fp8": e.fp8,
                                                 "expert_parallel": e.expert_parallel},
             "per_gpu_gib": round(self.per_gpu / GIB, 2)}
        if self.phases is not None:
            d["phases"] = self.phases.as_dict()
        return d


def search_rl(m: GLM5Config, job: Job, cluster: Cluster, limit: int = 8) -> list[RLLayout]:
    """Feasible RL layouts on ``cluster`` (at most its GPUs), colocated and separate, fewest GPUs first
    (then colocated before separate, then the emptiest fullest GPU, then the fewest bytes offloaded). Separate: a trainer layout of
    ``search_layouts`` plus one smallest engine that fits; colocated: a trainer
    layout whose ranks also hold a sleeping engine, tiled by the engine (``plan.colocate``) that fits
    the generation phase beside what the trainer keeps resident."""
    ro = job.rollout
    if ro is None:
        raise ValueError("search_rl: the job has no rollout section")
    found: list[RLLayout] = []
    engine = smallest_engine(m, cluster, ro.n, ro.prompt_tokens, ro.response_tokens, ro.engine)
    if engine is not None:
        for p in search_layouts(m, job, cluster, limit=limit):
            gpus = p.job.layout.world + engine.spec.gpus  # one engine: the fewest GPUs (more: throughput)
            used = engine.weights + ACTIVATION_RESERVE + engine.kv_budget
            found.append(RLLayout("separate", p, engine.spec, 1, gpus, max(p.worst.total, used)))
    step = cluster.gpus_per_node
    big = replace(cluster, nodes=10 ** 6, gpus_per_node=step)
    colocated = 0
    for world in range(step, cluster.num_gpus + 1, step):
        for L in candidate_layouts(m, job, world, step):
            try:
                p = plan_job(m, replace(job, layout=L, rollout=None), big)
            except ValueError:
                continue
            if not p.fits:
                continue
            got = best_colocated(m, p.worst, world, cluster, ro.n, ro.prompt_tokens, ro.response_tokens, ro.engine,
                                 ro.sleep_level)
            if got is None:
                continue
            e, ph = got
            found.append(RLLayout("colocated", p, e, world // e.gpus, world, ph.per_gpu, ph))
            colocated += 1
        if colocated >= limit:
            break
    found = [x for x in found if x.gpus <= cluster.num_gpus]
    found.sort(key=lambda x: (x.gpus, x.mode != "colocated", x.per_gpu, x.phases.move_bytes if x.phases else 0))
    return found[:limit]

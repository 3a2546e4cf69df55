"""``search_layouts``: the feasible layouts with the fewest GPUs, best first.

Worlds grow a node at a time; inside one, TP stays within a node (1..GPUs per node) and is tried
first, then EP, ETP, PP, CP (dimensions the job's recipe cannot change stay as they are). A layout is
feasible when every kind of rank fits the card. Best: fewest GPUs, then the least memory on the
fullest rank.
"""

from __future__ import annotations

from dataclasses import replace

from glm5_mcore.config import GLM5Config
from glm5_mcore.plan.cluster import Cluster
from glm5_mcore.plan.job import Job
from glm5_mcore.plan.layout import Layout
from glm5_mcore.plan.planner import Plan, plan_job


def _divisors(n: int, cap: int) -> list[int]:
    return [d for d in range(1, min(n, cap) + 1) if n % d == 0]


def candidate_layouts(m: GLM5Config, job: Job, world: int, gpus_per_node: int):
    cur = job.layout
    pow2 = [d for d in (1, 2, 4, 8, 16, 32) if d <= gpus_per_node]
    tps = [d for d in pow2 if m.num_attention_heads % d == 0 and m.vocab_size % d == 0]
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
                        L = Layout(world, tp, ep, etp, pp, cp)
                        if world % (tp * cp * pp) or world % (etp * ep * pp) or etp * ep > world // pp:
                            continue
                        yield L


def search_layouts(m: GLM5Config, job: Job, cluster: Cluster, limit: int = 8, min_world: int = 1) -> list[Plan]:
    """Feasible trainer layouts for ``job``, fewest GPUs first (at most ``limit``); the rollout
    engines and the cluster's size are not part of the search."""
    found: list[Plan] = []
    step = cluster.gpus_per_node
    worlds = [w for w in (1, 2, 4) if w < step] + list(range(step, 64 * step + 1, step))
    big = Cluster(cluster.gpu, cluster.gpu_mem_gib, nodes=10 ** 6, gpus_per_node=step, reserve_gib=cluster.reserve_gib)
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

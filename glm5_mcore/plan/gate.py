"""The gate ``glm5 sft`` and ``glm5 rl`` pass before any work on GPUs: plan the job on its cluster
and refuse a layout that cannot fit, with the numbers and the nearest layout that does
(``plan.check=false`` lets it start anyway, with a warning)."""

from __future__ import annotations

import warnings
from typing import Optional

from glm5_mcore.config import GLM5Config
from glm5_mcore.plan.cluster import GIB, Cluster, cluster_from
from glm5_mcore.plan.job import Job
from glm5_mcore.plan.planner import Plan, plan_job
from glm5_mcore.plan.rollout import smallest_engine
from glm5_mcore.plan.search import search_layouts


def nearest_layout(m: GLM5Config, job: Job, cluster: Cluster) -> Optional[Plan]:
    """A feasible layout with the fewest GPUs not below the job's, changing as few dimensions as possible."""
    found = search_layouts(m, job, cluster, limit=64, min_world=job.layout.world)
    if not found:
        return None
    world = found[0].job.layout.world
    cur = job.layout

    def changes(p: Plan) -> int:
        return sum(getattr(p.job.layout, d) != getattr(cur, d) for d in ("tp", "ep", "etp", "pp", "cp"))

    return min((p for p in found if p.job.layout.world == world), key=lambda p: (changes(p), p.worst.total))


def check_job(m: GLM5Config, job: Job, cluster: Cluster, check: bool = True) -> Plan:
    """The plan of ``job`` on ``cluster``; a ValueError with the numbers and the nearest layout that
    fits when it does not (a warning instead with ``check=False``)."""
    plan = plan_job(m, job, cluster)
    if plan.fits:
        return plan
    lines = [f"plan: the {job.kind} job does not fit on {cluster.describe()}:"]
    for r in plan.ranks:
        if not r.fits:
            s = r.state
            lines.append(f"  trainer {r.kind.name} (rank {r.kind.rank}): {r.total / GIB:.1f} GiB of "
                         f"{r.capacity / GIB:.1f} GiB usable: weights {(s.weights + s.buffers) / 1e9:.1f} GB "
                         f"({s.params / 1e9:.1f}B parameters, {s.expert_params / 1e9:.1f}B routed experts), "
                         f"activations {r.act.peak / GIB:.1f} GiB")
    lines += [f"  {p}" for p in plan.problems if not p.startswith("trainer")]
    if any(not r.fits for r in plan.ranks) and not (job.rollout is not None and job.rollout.colocate):
        near = nearest_layout(m, job, cluster)
        if near is not None:
            L = near.job.layout
            lines.append(f"  nearest trainer layout that fits: world {L.world}, TP {L.tp}, EP {L.ep}, ETP {L.etp}, "
                         f"PP {L.pp}, CP {L.cp} (fullest rank {near.worst.total / GIB:.1f} GiB)")
        else:
            act = max(r.act.peak for r in plan.ranks)
            lines.append(f"  no trainer layout the recipe can run fits up to 64 nodes (activations alone "
                         f"{act / GIB:.1f} GiB at {job.micro_batch_tokens} tokens per micro-batch): lower the "
                         "micro-batch tokens or turn on recompute")
    if job.rollout is not None and job.rollout.colocate:
        from glm5_mcore.plan.report import format_rl_row
        from glm5_mcore.plan.search import search_rl

        found = search_rl(m, job, cluster, limit=1)
        lines.append("  fewest GPUs that fit on this cluster:" + (format_rl_row(found[0])[1:] if found else " none"))
    elif plan.engine is not None and not plan.engine.fits:
        ro = job.rollout
        e = smallest_engine(m, cluster, ro.n, ro.prompt_tokens, ro.response_tokens, ro.engine)
        if e is not None:
            s = e.spec
            lines.append(f"  smallest rollout engine that fits: {s.gpus} GPUs, tensor_parallel_size={s.tp}, "
                         f"pipeline_parallel_size={s.pp}, enable_expert_parallel=true"
                         f"{', quantization=fp8' if s.fp8 else ''} ({e.weights / GIB:.1f} GiB weights per GPU)")
    lines.append("  (plan.check=false starts it anyway; glm5 plan prints the full table)")
    msg = "\n".join(lines)
    if check:
        raise ValueError(msg)
    warnings.warn(msg)
    return plan


def local_cluster(world: int) -> Cluster:
    """The GPUs this run finds: the first card's memory, ``world`` cards (8 per node), this node's RAM."""
    import os

    import torch

    mem = torch.cuda.get_device_properties(0).total_memory / GIB
    per_node = min(world, torch.cuda.device_count() or 1)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    return Cluster(gpu=torch.cuda.get_device_name(0), gpu_mem_gib=mem, nodes=-(-world // per_node),
                   gpus_per_node=per_node, host_mem_gib=ram)


def gate(m: GLM5Config, job: Job, cluster_spec: Optional[str], check: bool) -> Optional[Plan]:
    """What the recipes call before any work: only on GPUs (a CPU run is never refused)."""
    import torch

    if not torch.cuda.is_available():
        return None
    cluster = cluster_from(cluster_spec) if cluster_spec else local_cluster(job.trainer_gpus + job.rollout_gpus)
    return check_job(m, job, cluster, check)

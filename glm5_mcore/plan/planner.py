"""``plan_job``: every kind of rank of a job's layout sized against a cluster, and a verdict."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from glm5_mcore.config import GLM5Config
from glm5_mcore.plan.activations import DSA_STAGES, ActivationBytes, dsa_core_peak, stage_activations
from glm5_mcore.plan.cluster import GIB, Cluster
from glm5_mcore.plan.colocate import PhasePlan, engine_plan_of, plan_phases
from glm5_mcore.plan.host import HostPlan, host_problem, lora_host_bytes, plan_host
from glm5_mcore.plan.job import Job
from glm5_mcore.plan.layout import RankKind, rank_kinds
from glm5_mcore.plan.memory import StateBytes, state_bytes, te_dgrad_copy
from glm5_mcore.plan.params import lora_tensors, stage_tensors
from glm5_mcore.plan.push import lora_push_bytes, merged_push_bytes
from glm5_mcore.plan.rollout import EnginePlan, lora_buffers, plan_engine


@dataclass
class RankPlan:
    kind: RankKind
    state: StateBytes
    act: ActivationBytes
    act_no_recompute: ActivationBytes
    act_recompute: ActivationBytes
    dist_opt: bool
    capacity: int
    dsa_layer: dict = field(default_factory=dict)
    """One DSA layer's peak (``dsa_core_peak``) in each indexer training stage; the job's is in ``act``."""
    te_copy: int = 0
    """An FP8 base on TE: the column-wise copy one module makes inside its backward (``memory.te_dgrad_copy``)."""

    @property
    def total(self) -> int:
        s = self.state
        opt = (s.main_params_dist + s.optimizer_dist) if self.dist_opt else (s.main_params + s.optimizer)
        return s.weights + s.buffers + s.grads + opt + self.act.peak + self.te_copy

    @property
    def fits(self) -> bool:
        return self.total <= self.capacity

    def as_dict(self) -> dict:
        s, g = self.state, lambda x: round(x / GIB, 2)
        return {"rank": self.kind.rank, "kind": self.kind.name, "params_b": round(s.params / 1e9, 3),
                "expert_params_b": round(s.expert_params / 1e9, 3), "weights_gib": g(s.weights + s.buffers),
                "grads_gib": g(s.grads), "main_params_gib": g(s.main_params), "optimizer_gib": g(s.optimizer),
                "main_params_dist_gib": g(s.main_params_dist), "optimizer_dist_gib": g(s.optimizer_dist),
                "activations_gib": g(self.act.peak), "activations_no_recompute_gib": g(self.act_no_recompute.peak),
                "activations_recompute_gib": g(self.act_recompute.peak),
                "indexer_scores_gib": g(self.act.indexer_scores), "dsa_backward_gib": g(self.act.dsa_backward),
                "moe_dispatch_gib": g(self.act.dispatch),
                "dsa_layer_peak_gib": {k: g(v) for k, v in self.dsa_layer.items()},
                "te_fp8_dgrad_copy_gib": g(self.te_copy),
                "total_gib": g(self.total), "capacity_gib": g(self.capacity), "fits": self.fits}


@dataclass
class Plan:
    job: Job
    cluster: Cluster
    ranks: list
    engine: Optional[EnginePlan] = None
    problems: list = field(default_factory=list)
    phases: Optional[PhasePlan] = None
    """Colocated RL: the training and generation phases of one GPU (``plan.colocate``)."""
    push: dict = field(default_factory=dict)
    """RL: {family: bytes} one engine receives per step (``plan.push``; LoRA mode's merged families as
    ``merged:<family>``)."""
    host: Optional[HostPlan] = None
    """Host memory per node in each phase (``plan.host``)."""
    lora_buffers: int = 0
    """LoRA mode: vLLM's LoRA buffers per engine GPU (``plan.rollout.lora_buffers``; in the engine's weights)."""

    @property
    def fits(self) -> bool:
        return not self.problems

    @property
    def worst(self) -> RankPlan:
        return max(self.ranks, key=lambda r: r.total)

    def as_dict(self) -> dict:
        d = {"fits": self.fits, "cluster": self.cluster.describe(), "layout": self.job.layout.as_dict(),
             "gpus": self.job.trainer_gpus + self.job.rollout_gpus, "ranks": [r.as_dict() for r in self.ranks],
             "problems": self.problems}
        if self.engine is not None:
            d["rollout_engine"] = dict(self.engine.as_dict(), engines=self.job.rollout.engines,
                                       colocated=self.job.rollout.colocate)
        if self.phases is not None:
            d["colocated_per_gpu"] = self.phases.as_dict()
        if self.push:
            d["push_bytes_per_engine_step"] = sum(self.push.values())
            d["push_mode"] = "merged" if self.job.rollout.merge else "lora"
        if self.lora_buffers:
            d["engine_lora_buffers_gib"] = round(self.lora_buffers / GIB, 2)
        if self.host is not None:
            d["host_per_node"] = self.host.as_dict()
        return d


def plan_rank(m: GLM5Config, job: Job, kind: RankKind, capacity: int) -> RankPlan:
    L = job.layout
    base = stage_tensors(m, L, kind.stage, job.mtp)
    lora = lora_tensors(base, L, job.lora[0], job.lora[1], job.freeze_indexer) if job.lora else []
    st = state_bytes(base, lora, bf16=job.bf16, full_ft=job.lora is None, freeze_indexer=job.freeze_indexer,
                     dp_cp=L.dp_cp, expert_dp=L.expert_dp, base_fp8=job.base_fp8)
    acts = {rc: stage_activations(m, L, kind.stage, job.micro_batch_tokens, bf16=job.bf16, recompute=rc,
                                  mtp=job.mtp, microbatches=max(job.microbatches, L.pp), dsa_stage=job.dsa_stage)
            for rc in {False, True, job.recompute or False}}
    dsa = {}
    if any(t == "full" for t in m.indexer_types):
        dsa = {stage: dsa_core_peak(m, L, job.micro_batch_tokens, 2 if job.bf16 else 4, stage=stage)
               for stage in DSA_STAGES}
    te_copy = te_dgrad_copy(base, m.n_routed_experts // L.ep) if job.base_fp8 and job.backend == "te" else 0
    return RankPlan(kind, st, acts[job.recompute or False], acts[False], acts[True], job.dist_opt, capacity, dsa,
                    te_copy)


def plan_job(m: GLM5Config, job: Job, cluster: Cluster) -> Plan:
    """Size every kind of rank of ``job`` (and its rollout engine) on ``cluster``."""
    L = job.layout
    L.validate(m)
    ranks = [plan_rank(m, job, k, cluster.usable_bytes) for k in rank_kinds(L, job.mtp)]
    plan = Plan(job, cluster, ranks)
    for r in ranks:
        if not r.fits:
            plan.problems.append(f"trainer {r.kind.name} (rank {r.kind.rank}) needs {r.total / GIB:.1f} GiB "
                                 f"(weights {(r.state.weights + r.state.buffers) / 1e9:.1f} GB), "
                                 f"{cluster.gpu} has {r.capacity / GIB:.1f} GiB usable")
    if job.rollout is not None and job.rollout.colocate:
        ro = job.rollout
        plan.phases = plan_phases(m, plan.worst, ro.engine, cluster, ro.n, ro.prompt_tokens, ro.response_tokens,
                                  ro.offload_weights, ro.sleep_level)
        plan.engine = engine_plan_of(m, plan.phases, ro.engine, ro.n)
        if ro.engines * ro.engine.gpus != L.world:
            plan.problems.append(f"colocated: {ro.engines} engine(s) x {ro.engine.gpus} GPUs must tile the trainer's "
                                 f"{L.world} GPUs (rollout.num_actors x tensor x pipeline parallel)")
        p = plan.phases
        if p.training > p.capacity:
            plan.problems.append(f"colocated training phase needs {p.training / GIB:.1f} GiB per GPU (trainer "
                                 f"{p.trainer_total / GIB:.1f} + sleeping engine), {p.capacity / GIB:.1f} usable")
        if p.generation > p.capacity or p.kv_budget < p.kv_group:
            plan.problems.append(f"colocated generation phase needs {p.generation / GIB:.1f} GiB per GPU (engine "
                                 f"weights {p.engine_weights / GIB:.1f} + KV for a group {p.kv_group / GIB:.1f} + "
                                 f"trainer resident {p.trainer_resident / GIB:.1f}), {p.capacity / GIB:.1f} usable"
                                 + ("" if p.offload_weights else "; rollout.colocate.offload_weights=true moves "
                                    "the frozen base weights to host memory for it"))
    elif job.rollout is not None:
        ro = job.rollout
        plan.engine = plan_engine(m, ro.engine, cluster, ro.n, ro.prompt_tokens, ro.response_tokens)
        if ro.gpus_per_engine and ro.gpus_per_engine != ro.engine.gpus:
            plan.problems.append(f"rollout.gpus_per_actor={ro.gpus_per_engine:g} but the engine spans "
                                 f"tensor x pipeline x data parallel = {ro.engine.gpus} GPUs")
        if not plan.engine.fits:
            plan.problems.append(f"rollout engine ({ro.engine.gpus} GPUs): {plan.engine.why} "
                                 f"(weights {plan.engine.weights / GIB:.1f} GiB per GPU)")
    if job.rollout is not None and job.lora:
        ro = job.rollout
        plan.push = (merged_push_bytes(m, job.lora[0], ro.engine.fp8) if ro.merge else
                     lora_push_bytes(m, job.lora[0], job.lora[1], ro.engine.fp8, ro.payload_bytes))
        plan.lora_buffers = lora_buffers(m, plan.engine.spec if plan.engine is not None else ro.engine)
    lora_host = 0
    if plan.lora_buffers:
        served = sum(v for k, v in plan.push.items() if not k.startswith("merged:"))
        lora_host = lora_host_bytes(served, plan.lora_buffers, job.rollout.engine.max_loras)
    plan.host = plan_host(job, plan.phases, cluster, job.rollout_gpus, lora_host)
    if (why := host_problem(plan.host, cluster)) is not None:
        plan.problems.append(why)
    need = job.trainer_gpus + job.rollout_gpus
    if need > cluster.num_gpus:
        plan.problems.append(f"the job needs {need} GPUs ({job.trainer_gpus} trainer + {job.rollout_gpus} rollout), "
                             f"the cluster has {cluster.num_gpus}")
    return plan

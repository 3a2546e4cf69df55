"""What is planned: a training job's layout and settings, read from an SFT or RL config dict.

``PlanCfg`` is the ``plan`` section both recipes' configs carry: the cluster the config is sized for,
and the switch that lets a run start although the planner says it does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from glm5_mcore.lora.config import DEFAULT_TARGETS
from glm5_mcore.plan.layout import Layout
from glm5_mcore.plan.rollout import EngineSpec


@dataclass
class PlanCfg:
    cluster: Optional[str] = None
    """Preset and node count the config is sized for, e.g. ``h100:16`` (``glm5_mcore.plan.cluster``);
    None: the GPUs the run finds."""
    check: bool = True
    """Plan before any work on GPUs and refuse a layout that cannot fit; ``plan.check=false`` overrides."""


@dataclass(frozen=True)
class RolloutJob:
    engines: int
    engine: EngineSpec
    n: int
    prompt_tokens: int
    response_tokens: int
    gpus_per_engine: float = 0.0
    """What Ray reserves per engine actor (``rollout.gpus_per_actor``)."""


@dataclass(frozen=True)
class Job:
    kind: str
    """``sft`` or ``rl``."""
    layout: Layout
    micro_batch_tokens: int
    microbatches: int = 1
    bf16: bool = True
    recompute: bool = False
    distributed_optimizer: Optional[bool] = None
    """None: Megatron's distributed optimizer on when DP > 1 (``training.build_trainer`` on CUDA)."""
    lora: Optional[tuple] = None
    """(targets, rank) for LoRA; None for full fine-tuning."""
    freeze_indexer: bool = True
    mtp: bool = True
    rollout: Optional[RolloutJob] = None
    cluster: Optional[str] = None
    fixed: tuple = ()
    """Layout dimensions the recipe cannot change (e.g. ``("pp", "cp", "etp")`` for the RL trainer)."""

    @property
    def dist_opt(self) -> bool:
        if self.distributed_optimizer is not None:
            return bool(self.distributed_optimizer)
        return self.layout.dp_cp > 1 or self.layout.expert_dp > 1

    @property
    def trainer_gpus(self) -> int:
        return self.layout.world

    @property
    def rollout_gpus(self) -> int:
        return self.rollout.engines * self.rollout.engine.gpus if self.rollout else 0


def sft_job(d: dict, world: int) -> Job:
    """From a resolved ``configs/sft*.yaml`` dict, run on ``world`` ranks."""
    p, t, data = d.get("parallel", {}), d.get("train", {}), d.get("data", {})
    layout = Layout(world=world, tp=int(p.get("tp", 1)), ep=int(p.get("ep", 1)), etp=int(p.get("etp", 1)),
                    pp=int(p.get("pp", 1)), cp=int(p.get("cp", 1)))
    lora = d.get("lora") or {}
    dp = max(1, world // (layout.tp * layout.cp * layout.pp))
    micro = int(data.get("micro_batch_tokens", 1024))
    accum = max(1, int(data.get("global_batch_tokens", micro)) // (micro * dp))
    return Job(kind="sft", layout=layout, micro_batch_tokens=micro, microbatches=accum,
               bf16=bool(t.get("bf16", False)), recompute=bool(t.get("recompute", False)),
               distributed_optimizer=d.get("optim", {}).get("distributed"),
               lora=(tuple(lora.get("targets", DEFAULT_TARGETS)), int(lora.get("rank", 16)))
               if lora.get("enabled", True) else None,
               freeze_indexer=bool(t.get("freeze_indexer", True)), mtp=True,
               cluster=(d.get("plan") or {}).get("cluster"), fixed=("etp",))


def rl_job(d: dict) -> Job:
    """From a resolved ``configs/rl/*.yaml`` dict: the trainer (TP × EP × CP, LoRA, MTP only with
    ``actor.mtp_loss_scale > 0`` or ``actor.mtp_accept``) and the engines."""
    t, a, r, data = d.get("trainer", {}), d.get("actor", {}), d.get("rollout", {}), d.get("data", {})
    layout = Layout(world=int(t.get("world_size", 1)), tp=int(t.get("tp", 1)), ep=int(t.get("ep", 1)),
                    cp=int(t.get("cp", 1)))
    lora = d.get("lora") or {}
    engine = EngineSpec.from_engine_kwargs(dict(r.get("engine_kwargs") or {}))
    ro = RolloutJob(engines=int(r.get("num_actors", 1)), engine=engine, n=int(r.get("n", 8)),
                    prompt_tokens=int(data.get("max_prompt_tokens", 512)),
                    response_tokens=int(r.get("max_new_tokens", 8)),
                    gpus_per_engine=float(r.get("gpus_per_actor", 0.0)))
    return Job(kind="rl", layout=layout, micro_batch_tokens=int(a.get("micro_batch_tokens", 4096)),
               bf16=bool(t.get("bf16", False)), lora=(tuple(lora.get("targets", DEFAULT_TARGETS)), int(lora.get("rank", 16))),
               freeze_indexer=bool(t.get("freeze_indexer", True)),
               mtp=float(a.get("mtp_loss_scale", 0.0)) > 0 or bool(a.get("mtp_accept", False)), rollout=ro,
               cluster=(d.get("plan") or {}).get("cluster"), fixed=("pp", "etp"))

"""What is planned: a training job's layout and settings, read from a typed SFT or RL config (the recipes'
schemas; this module reads their sections by attribute and keeps no defaults of its own).

``PlanCfg`` is the ``plan`` section both recipes' configs carry: the cluster the config is sized for,
and the switch that lets a run start although the planner says it does not fit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from glm5_mcore.lora.config import VLLM_LORA
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
    colocate: bool = False
    """The engines time-share the trainer's GPUs (``rollout.colocate.enable``): no GPUs of their own."""
    offload_weights: bool = False
    sleep_level: int = 1
    merge: bool = False
    """The engines take merged weights (``rollout.engine_kwargs.merge``); else LoRA mode (``plan.push``'s bytes)."""
    payload_bytes: int = 4
    """Bytes per adapter number in a push: 2 with ``trainer.bf16`` (the trainer exports bf16), else 4."""


@dataclass(frozen=True)
class Job:
    kind: str
    """``sft`` or ``rl``."""
    layout: Layout
    micro_batch_tokens: int
    microbatches: int = 1
    bf16: bool = True
    recompute: object = False
    """False, True / ``"full"`` or ``"selective"`` (``glm5_mcore.mcore_settings.recompute_overrides``)."""
    distributed_optimizer: Optional[bool] = None
    """None: Megatron's distributed optimizer on when DP > 1 (``training.build_trainer`` on CUDA)."""
    lora: Optional[tuple] = None
    """(targets, rank) for LoRA; None for full fine-tuning."""
    freeze_indexer: bool = True
    base_fp8: bool = False
    """``model.base_dtype=fp8``: the frozen base in the release's FP8 blocks (LoRA only)."""
    backend: str = "local"
    """The trainer's layer-spec backend (``trainer.backend``; SFT runs the local spec): with ``te`` an FP8 base's
    module makes its column-wise copy inside its backward (``model.fp8_te``)."""
    mtp: bool = True
    dsa_stage: str = "sparse"
    """The DSA indexer's training stage (``plan.activations.DSA_STAGES``): ``sparse`` (frozen), ``sparse_loss``
    (``train.freeze_indexer=false``), ``warmup`` (``train.indexer_warmup=true``)."""
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
        if not self.rollout or self.rollout.colocate:
            return 0
        return self.rollout.engines * self.rollout.engine.gpus


def sft_job(cfg, world: int, etp: Optional[int] = None) -> Job:
    """From an SFT config (``recipes.sft_config.SFTConfig``: its ``parallel``, ``data``, ``train``, ``optim``,
    ``lora`` and ``plan`` sections, typed, so every default is the schema's), run on ``world`` ranks;
    ``etp``: the expert-TP size to plan for (None: ``parallel.etp``)."""
    p, t, data, lora = cfg.parallel, cfg.train, cfg.data, cfg.lora
    layout = Layout(world=world, tp=p.tp, ep=p.ep, etp=etp or p.etp, pp=p.pp, cp=p.cp,
                    make_vocab_size_divisible_by=p.make_vocab_size_divisible_by)
    dp = max(1, world // (layout.tp * layout.cp * layout.pp))
    accum = max(1, data.global_batch_tokens // (data.micro_batch_tokens * dp))
    return Job(kind="sft", layout=layout, micro_batch_tokens=data.micro_batch_tokens, microbatches=accum,
               bf16=t.bf16, recompute=t.recompute, distributed_optimizer=cfg.optim.distributed,
               lora=(tuple(lora.targets), lora.rank) if lora.enabled else None,
               freeze_indexer=t.freeze_indexer, base_fp8=cfg.model.base_dtype == "fp8", mtp=True,
               cluster=cfg.plan.cluster,
               dsa_stage="warmup" if t.indexer_warmup else "sparse" if t.freeze_indexer else "sparse_loss")


def rl_job(cfg) -> Job:
    """From an RL config (``rl.config.RLConfig``, typed): the trainer (TP × EP × ETP × CP, recompute, LoRA, MTP only with
    ``actor.mtp_loss_scale > 0`` or ``actor.mtp_accept``) and the engines."""
    t, a, r = cfg.trainer, cfg.actor, cfg.rollout
    layout = Layout(world=t.world_size, tp=t.tp, ep=t.ep, etp=t.etp, cp=t.cp,
                    make_vocab_size_divisible_by=t.make_vocab_size_divisible_by)
    kw = dict(r.engine_kwargs or {})
    engine = EngineSpec.from_engine_kwargs(kw)
    if not kw.get("merge"):  # LoRA mode: vLLM's LoRA buffers (the defaults ``rl.rollout.vllm_lora`` fills)
        engine = replace(engine, lora_families=tuple(f for f in cfg.lora.targets if f in VLLM_LORA),
                         max_lora_rank=int(kw.get("max_lora_rank", 64)),
                         max_loras=int(kw.get("max_loras", t.max_staleness + 1)))
    co = r.colocate
    level = co.sleep_level if co.sleep_level is not None else (2 if kw.get("merge") else 1)
    ro = RolloutJob(engines=r.num_actors, engine=engine, n=r.n, prompt_tokens=cfg.data.max_prompt_tokens,
                    response_tokens=r.max_new_tokens, gpus_per_engine=float(r.gpus_per_actor),
                    colocate=co.enable, offload_weights=co.offload_weights, sleep_level=int(level),
                    merge=bool(kw.get("merge")), payload_bytes=2 if t.bf16 else 4)
    return Job(kind="rl", layout=layout, micro_batch_tokens=a.micro_batch_tokens, bf16=t.bf16,
               recompute=t.recompute or False,
               lora=(tuple(cfg.lora.targets), cfg.lora.rank), freeze_indexer=t.freeze_indexer,
               base_fp8=cfg.model.base_dtype == "fp8", backend=t.backend, mtp=a.mtp_loss_scale > 0 or a.mtp_accept,
               rollout=ro, cluster=cfg.plan.cluster, fixed=("pp",))

"""``SFTConfig``: the SFT / continued-pretraining run as typed dataclasses (the schema of ``configs/sft.yaml``).

The sections both recipes share (``model``, ``lora``, ``parallel``, ``optim``, ``wandb``, ``plan``) come from
``glm5_mcore.training.schema``; ``data`` and ``train`` are the recipe's own. ``SFTConfig.from_dict`` builds it
from a plain dict with OmegaConf (unknown keys, wrong types and ``???`` values name the key); Hydra registers
the same class as the schema ``configs/sft.yaml`` composes onto (``recipes.hydra_app``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

from glm5_mcore.training.schema import (LoRACfg, ModelCfg, OptimCfg, ParallelConfig, PlanCfg, WandbCfg,  # noqa: F401
                                      build)


@dataclass
class DataCfg:
    """Rows are jsonl ({"prompt", "response"}, {"messages": [...]}, {"text"}) or indexed datasets."""
    train: str = ""
    """A jsonl file, or an indexed dataset (a ``glm5 data preprocess`` folder / a Megatron prefix)."""
    valid: Optional[str] = None
    """Validation data of the same kind (jsonl for jsonl training data)."""
    micro_batch_tokens: int = 1024
    """Token budget of one THD-packed micro-batch (no padding)."""
    global_batch_tokens: int = 4096
    """Tokens per optimizer step: gradient accumulation = global / (micro x DP)."""
    max_tokens: int = 1024
    """Documents are cut to this many training positions (counted as ``truncated_rows``)."""
    skip_bad_rows: bool = False
    """Skip and count malformed rows instead of stopping at the first (``file:line``)."""
    seed: int = 1234
    blend: Optional[Any] = None
    """Weighted indexed datasets instead of ``train``: ``[0.7, web, 0.3, code]`` or ``"0.7 web 0.3 code"``."""
    split: Optional[str] = None
    """Megatron's train/valid/test split of indexed ``train``/``blend`` by documents, e.g. ``"969,30,1"``."""


@dataclass
class TrainCfg:
    steps: int = 100
    out: str = "runs/sft"
    """The run folder: checkpoints, W&B, ``.hydra/config.yaml``; under ``-m`` the sweep's root, each job in
    ``out/N`` (Hydra's job number)."""
    eval_every: int = 0
    save_every: int = 0
    keep_last: int = 2
    """Iterations kept on disk (older ones pruned)."""
    log_every: int = 1
    seed: int = 1234
    bf16: bool = False
    """GPU: bf16 mixed precision (fp32 master weights)."""
    recompute: Union[bool, str] = False
    """Megatron's activation recompute (``glm5_mcore.mcore_settings.recompute_overrides``): false, true / ``full``
    (every layer keeps only its input) or ``selective`` (the core attention); CPU and GPU."""
    cpu_offload: bool = False
    """GPU: optimizer state offload."""
    mtp_loss_scale: float = 0.1
    moe_aux_loss_coeff: float = 0.0
    """> 0 adds Megatron's sequence-level auxiliary load-balancing loss (GLM-5 trains without)."""
    moe_bias_update_rate: float = 0.0
    """> 0 lets the expert bias (e_score_correction_bias) drift; the release keeps it fixed."""
    freeze_indexer: bool = True
    """False: the sparse stage — the model attends to the top-k keys and the indexer keeps learning with
    Megatron-Core's sparse KL loss (full fine-tuning: its weights; LoRA: adapters on its linears)."""
    indexer_warmup: bool = False
    """Warm-up stage: everything frozen but the indexer, trained with the KL indexer loss against
    dense attention (which the model uses meanwhile); logs the top-k recall of dense attention mass."""
    indexer_loss_coeff: float = 0.001
    """Weight of the indexer's KL loss (warm-up and sparse stage; Megatron-Bridge's GLM-5 default).
    Logged as ``indexer/loss`` (mean KL per query row) and ``indexer/recall``."""
    resume: bool = True
    allow_resume_mismatch: bool = False
    """Resume even if data files, batch sizes, LoRA, model settings or the LR schedule's length (``train.steps``
    under a decaying ``optim.decay_style``) differ from the run's; the schedule is then this run's, from the
    saved step."""
    progress: bool = True


@dataclass
class SFTConfig:
    model: ModelCfg = field(default_factory=ModelCfg)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRACfg = field(default_factory=LoRACfg)
    data: DataCfg = field(default_factory=DataCfg)
    optim: OptimCfg = field(default_factory=OptimCfg)
    train: TrainCfg = field(default_factory=TrainCfg)
    wandb: WandbCfg = field(default_factory=WandbCfg)
    plan: PlanCfg = field(default_factory=PlanCfg)

    @staticmethod
    def from_dict(d: Optional[dict]) -> "SFTConfig":
        """From a plain dict (a resolved Hydra config); unknown keys, wrong types and ``???`` values are
        errors naming the field."""
        return build(SFTConfig, d)

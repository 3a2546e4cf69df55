"""Hydra entry points of the recipes: ``glm5 sft [--config NAME] [overrides...]`` and ``glm5 rl [--config NAME]
[overrides...]`` (Hydra's command line: ``--help``, ``--cfg job``, ``-m``; ``recipes.hydra_app``). Hydra stops
here: the recipe gets a plain ``SFTConfig`` / ``RLConfig``."""

from __future__ import annotations

import os

from recipes.hydra_app import CONFIG_DIR, compose, job_dict, run_app, save_job_config, shipped_config  # noqa: F401


def plan_gate(kind: str, cfg, hf_dir: str) -> None:
    """Plan the job of the typed config ``cfg`` (``SFTConfig`` / ``RLConfig``) before any work when it runs
    on GPUs (``glm5_mcore.plan.gate``); a layout that cannot fit is refused with the numbers and the nearest
    one that fits (``plan.check=false``: a warning)."""
    import torch

    if not torch.cuda.is_available():
        return
    from glm5_mcore.config import GLM5Config
    from glm5_mcore.plan.gate import gate
    from glm5_mcore.plan.job import rl_job, sft_job

    job = rl_job(cfg) if kind == "rl" else sft_job(cfg, int(os.environ.get("WORLD_SIZE", "1")))
    gate(GLM5Config.from_hf_dir(hf_dir), job, cfg.plan.cluster, cfg.plan.check)


def sft_main(argv: list[str]) -> int:
    """``glm5 sft [--config NAME] key=value ...`` with ``configs/NAME.yaml`` (default sft)."""
    return run_app("sft", argv, _sft_job)


def _sft_job(cfg) -> None:
    import json

    import torch.distributed as dist

    from glm5_mcore.training.model_source import hf_dir_of
    from recipes.sft import SFTConfig, run

    d = job_dict("sft", cfg)
    c = SFTConfig.from_dict(d)
    plan_gate("sft", c, hf_dir_of(c.model))
    out = run(c, record=lambda: save_job_config(c.train.out, d))
    if not dist.is_initialized() or dist.get_rank() == 0:
        hist = out["history"]
        summary = {"steps": out["state"]["step"], "first_loss": hist[0]["loss"] if hist else None,
                   "last_loss": hist[-1]["loss"] if hist else None, "val": out["val"],
                   "losses": [h["loss"] for h in hist], "skipped_rows": out["data"]["skipped"],
                   "truncated_rows": out["data"]["truncated"],
                   "valid_truncated_rows": out["valid_data"]["truncated"], "out": c.train.out}
        for key in ("indexer/loss", "indexer/recall"):  # DSA warm-up / sparse stage, frozen-indexer recall
            if any(key in h for h in hist):
                summary[key] = [round(h[key], 5) if key in h else None for h in hist]
        print(json.dumps(summary))


def rl_main(argv: list[str]) -> int:
    """``glm5 rl [--config NAME] key=value ...`` with ``configs/rl/NAME.yaml`` (default grpo_tiny)."""
    import warnings

    for module in (r"megatron\.", r"transformers\."):  # library deprecation chatter, not ours
        warnings.filterwarnings("ignore", module=module)
    return run_app("rl", argv, _rl_job)


def _rl_job(cfg) -> None:
    import json

    from rl.config import RLConfig
    from rl.driver import run

    d = job_dict("rl", cfg)
    c = RLConfig.from_dict(d)
    plan_gate("rl", c, c.model.hf_dir)
    out = run(c, record=lambda: save_job_config(c.trainer.out, d))
    hist = out["history"]
    rewards = [h["critic/score/mean"] for h in hist]
    print(json.dumps({"steps": out["state"]["step"], "val_reward": out["val"],
                      "first_reward": rewards[0] if rewards else None,
                      "last_reward": rewards[-1] if rewards else None,
                      "rewards": [round(x, 4) for x in rewards],
                      "out": c.trainer.out}))

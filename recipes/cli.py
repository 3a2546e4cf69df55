"""Hydra entry points of the recipes: ``glm5 sft [overrides...]`` and ``glm5 rl [--config NAME]
[overrides...]``. Hydra stops here: the recipe gets a plain ``SFTConfig`` / ``RLConfig``."""

from __future__ import annotations

import os
from pathlib import Path

CONFIG_DIR = Path(os.environ.get("GLM5_CONFIG_DIR", Path(__file__).resolve().parent.parent / "configs"))


def compose(name: str, overrides: list[str], require_all: bool = True) -> dict:
    """The resolved config ``configs/{name}.yaml`` with command-line ``overrides`` as a plain dict
    (``require_all=False``: ``???`` values are left as they are, for ``glm5 plan``)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    if not (CONFIG_DIR / f"{name}.yaml").is_file():
        raise FileNotFoundError(f"{CONFIG_DIR / (name + '.yaml')}: missing; run from a source checkout "
                                "(pip install -e .) or set GLM5_CONFIG_DIR")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            cfg = hydra_compose(config_name=name, overrides=overrides)
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=require_all)
    except (HydraException, OmegaConfBaseException) as e:
        raise ValueError(f"configs/{name}.yaml + overrides: {e}") from None


def _config_name(argv: list[str], default: str) -> tuple[str, list[str]]:
    """``--config NAME`` (or ``--config=NAME``) at the front of ``argv``, and the overrides after it."""
    if argv[:1] == ["--config"] and len(argv) > 1:
        return argv[1], argv[2:]
    if argv and argv[0].startswith("--config="):
        return argv[0].split("=", 1)[1], argv[1:]
    return default, argv


def plan_gate(kind: str, d: dict, hf_dir: str, check: bool) -> None:
    """Plan the job before any work when it runs on GPUs (``glm5_mcore.plan.gate``); a layout that
    cannot fit is refused with the numbers and the nearest one that fits."""
    import torch

    if not torch.cuda.is_available():
        return
    from glm5_mcore.config import GLM5Config
    from glm5_mcore.plan.gate import gate
    from glm5_mcore.plan.job import rl_job, sft_job

    job = rl_job(d) if kind == "rl" else sft_job(d, int(os.environ.get("WORLD_SIZE", "1")))
    gate(GLM5Config.from_hf_dir(hf_dir), job, (d.get("plan") or {}).get("cluster"), check)


def sft_main(argv: list[str]) -> int:
    """``glm5 sft [--config NAME] key=value ...`` with ``configs/NAME.yaml`` (default sft)."""
    import json

    import torch.distributed as dist

    from recipes.sft import SFTConfig, _hf_dir, run

    name, overrides = _config_name(argv, "sft")
    d = compose(name, overrides)
    cfg = SFTConfig.from_dict(d)
    plan_gate("sft", d, _hf_dir(cfg), cfg.plan.check)
    out = run(cfg)
    if not dist.is_initialized() or dist.get_rank() == 0:
        hist = out["history"]
        summary = {"steps": out["state"]["step"], "first_loss": hist[0]["loss"] if hist else None,
                   "last_loss": hist[-1]["loss"] if hist else None, "val": out["val"],
                   "losses": [h["loss"] for h in hist], "skipped_rows": out["data"]["skipped"],
                   "truncated_rows": out["data"]["truncated"],
                   "valid_truncated_rows": out["valid_data"]["truncated"]}
        for key in ("indexer/loss", "indexer/recall"):  # DSA warm-up / sparse stage, frozen-indexer recall
            if any(key in h for h in hist):
                summary[key] = [round(h[key], 5) if key in h else None for h in hist]
        print(json.dumps(summary))
    return 0


def rl_main(argv: list[str]) -> int:
    """``glm5 rl [--config NAME] key=value ...`` with ``configs/rl/NAME.yaml`` (default grpo_tiny)."""
    import json
    import warnings

    for module in (r"megatron\.", r"transformers\."):  # library deprecation chatter, not ours
        warnings.filterwarnings("ignore", module=module)
    from rl.config import RLConfig
    from rl.driver import run

    name, argv = _config_name(argv, "grpo_tiny")
    d = compose(f"rl/{name}", argv)
    cfg = RLConfig.from_dict(d)
    from rl.mtp import check_mtp_loss

    check_mtp_loss(cfg)
    plan_gate("rl", d, cfg.model.hf_dir, cfg.plan.check)
    out = run(cfg)
    hist = out["history"]
    rewards = [h["critic/score/mean"] for h in hist]
    print(json.dumps({"steps": out["state"]["step"], "val_reward": out["val"],
                      "first_reward": rewards[0] if rewards else None,
                      "last_reward": rewards[-1] if rewards else None,
                      "rewards": [round(x, 4) for x in rewards],
                      "out": cfg.trainer.out}))
    return 0

"""Hydra entry points of the recipes: ``glm5 sft [overrides...]`` and ``glm5 rl [--config NAME]
[overrides...]``. Hydra stops here: the recipe gets a plain ``SFTConfig`` / ``RLConfig``."""

from __future__ import annotations

import os
from pathlib import Path

CONFIG_DIR = Path(os.environ.get("GLM5_CONFIG_DIR", Path(__file__).resolve().parent.parent / "configs"))


def compose(name: str, overrides: list[str]) -> dict:
    """The resolved config ``configs/{name}.yaml`` with command-line ``overrides`` as a plain dict."""
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
        return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
    except (HydraException, OmegaConfBaseException) as e:
        raise ValueError(f"configs/{name}.yaml + overrides: {e}") from None


def sft_main(overrides: list[str]) -> int:
    import json

    import torch.distributed as dist

    from recipes.sft import SFTConfig, run

    cfg = SFTConfig.from_dict(compose("sft", overrides))
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

    name = "grpo_tiny"
    if argv[:1] == ["--config"] and len(argv) > 1:
        name, argv = argv[1], argv[2:]
    elif argv and argv[0].startswith("--config="):
        name, argv = argv[0].split("=", 1)[1], argv[1:]
    cfg = RLConfig.from_dict(compose(f"rl/{name}", argv))
    out = run(cfg)
    hist = out["history"]
    rewards = [h["critic/score/mean"] for h in hist]
    print(json.dumps({"steps": out["state"]["step"], "val_reward": out["val"],
                      "first_reward": rewards[0] if rewards else None,
                      "last_reward": rewards[-1] if rewards else None,
                      "rewards": [round(x, 4) for x in rewards],
                      "out": cfg.trainer.out}))
    return 0

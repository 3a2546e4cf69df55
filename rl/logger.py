"""W&B (offline unless a project/mode is set) + a console progress bar for the RL driver."""

from __future__ import annotations

from dataclasses import asdict

from glm5_mcore.training import init_wandb

CONSOLE_KEYS = (("reward", "critic/score/mean"), ("val", "val/reward"), ("len", "response_length/mean"),
                ("pg", "actor/pg_loss"), ("clip", "actor/pg_clipfrac"), ("ent", "actor/entropy"),
                ("kl", "actor/ref_kl"), ("k3", "rollout_corr/k3_kl"), ("masked", "rollout_corr/rollout_is_oob_ratio"),
                ("vf", "critic/vf_loss"), ("moe", "moe/max_over_mean"), ("s", "timing_s/step"))


class RLLogger:
    def __init__(self, cfg, start_step: int = 0):
        self.run = None
        self.bar = None
        self.history: list[dict] = []
        self.run = init_wandb(cfg.wandb, cfg.trainer.out, asdict(cfg))
        if cfg.trainer.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.trainer.steps, initial=start_step, desc="rl", dynamic_ncols=True)

    def log(self, step: int, metrics: dict) -> None:
        self.history.append({"step": step, **metrics})
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
        if self.run is not None:
            self.run.log(scalars, step=step)
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix({short: f"{scalars[k]:.3g}" for short, k in CONSOLE_KEYS if k in scalars},
                                 refresh=True)

    def note(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.run is not None:
            self.run.finish()

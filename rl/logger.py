"""The RL driver's metrics (W&B, offline unless a project/mode is set, and ``trainer.out/metrics.jsonl``:
``glm5_mcore.training.run_log``) + a console progress bar."""

from __future__ import annotations

from dataclasses import asdict

from glm5_mcore.training.run_log import RunLog

CONSOLE_KEYS = (("reward", "critic/score/mean"), ("val", "val/reward"), ("len", "response_length/mean"),
                ("pg", "actor/pg_loss"), ("clip", "actor/pg_clipfrac"), ("ent", "actor/entropy"),
                ("kl", "actor/ref_kl"), ("k3", "rollout_corr/k3_kl"), ("masked", "rollout_corr/rollout_is_oob_ratio"),
                ("vf", "critic/vf_loss"), ("moe", "moe/max_over_mean"), ("s", "timing_s/step"))


class RLLogger:
    def __init__(self, cfg, start_step: int = 0):
        self.run = None
        self.bar = None
        self.history: list[dict] = []
        self.run = RunLog(cfg.wandb, cfg.trainer.out, asdict(cfg), start_step)
        if cfg.trainer.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.trainer.steps, initial=start_step, desc="rl", dynamic_ncols=True)

    def log(self, step: int, metrics: dict) -> None:
        self.history.append({"step": step, **metrics})
        scalars = self.run.log(step, metrics)
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix({short: f"{scalars[k]:.3g}" for short, k in CONSOLE_KEYS if k in scalars},
                                 refresh=True)

    def log_eval(self, step: int, metrics: dict) -> None:
        """An evaluation outside a training step (before the first one): the metrics sinks only."""
        self.run.log(step, metrics)

    def note(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.run.close()

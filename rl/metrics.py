"""What one RL step reports: its W&B metrics (``step_metrics``), the lines it writes in the run's log
(``step_notes``) and what the console's progress bar shows of them (``CONSOLE_KEYS``).

``StepDone`` is a trained step as the driver hands it over: the metrics the algorithm produced (rollout
correction, advantages, the update), the samples, the padded batch, the pushed adapter and the phase timings.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from rl.tasks.episodes import tool_metrics
from rl.train.batch import RolloutBatch

CONSOLE_KEYS = (("reward", "critic/score/mean"), ("val", "val/reward"), ("len", "response_length/mean"),
                ("pg", "actor/pg_loss"), ("clip", "actor/pg_clipfrac"), ("ent", "actor/entropy"),
                ("kl", "actor/ref_kl"), ("k3", "rollout_corr/k3_kl"), ("masked", "rollout_corr/rollout_is_oob_ratio"),
                ("vf", "critic/vf_loss"), ("moe", "moe/max_over_mean"), ("s", "timing_s/step"))
"""``(short name, metric key)`` of the progress bar (``glm5_mcore.training.run_log.RunLogger``)."""


@dataclass
class StepDone:
    metrics: dict
    """The algorithm's metrics: rollout correction, the sources' rollout metrics, R3 / top-k agreement,
    advantages, batch statistics, the update's (``skip_reasons`` among them when an update was skipped)."""
    got: Any
    """The step's samples (``rl.schedule.step_source.StepSamples``): ``results``, ``scores``."""
    batch: RolloutBatch
    payload: Any
    """The adapter pushed after the update (``rl.rollout.base.AdapterPayload``)."""
    timing: dict
    """``timing_s/*`` of the step's phases."""
    started: float
    """``time.perf_counter()`` at the start of the step."""


def step_notes(cfg, step: int, done: StepDone, source, rollouts, rewards) -> list[str]:
    """The log lines of step ``step`` (counted from 1): non-finite rollout log-probs, skipped updates
    (``skip_reasons`` leaves the metrics), then the engines' and the reward function's events since the last step
    (each list taken and emptied)."""
    notes = []
    if frac := done.metrics["rollout/nonfinite_logprob_fraction"]:
        notes.append(f"step {step}: {frac:.1%} of the response tokens have non-finite rollout log-probs "
                     "(masked out of the loss)")
    notes += [f"step {step}: update skipped ({why})" for why in done.metrics.pop("skip_reasons", [])]
    events, rollouts.events = rollouts.events, []  # a gather in flight may add more
    events, rewards.events = events + rewards.events, []
    return notes + [f"step {step}: {event}" for event in events]


def step_metrics(done: StepDone, actor_restarts: int) -> dict:
    """The step's W&B metrics: the algorithm's, then the rollout's counts (engine restarts so far, distinct
    samples generated), tool episodes' counts, the phase timings (``timing_s/step`` up to now) and throughput."""
    metrics, timing, batch = done.metrics, done.timing, done.batch
    metrics["rollout/actor_restarts"] = float(actor_restarts)
    metrics["rollout/samples"] = float(len({(res.round, res.key) for res in done.got.results}))
    metrics.update(tool_metrics(done.got.results))
    gen_tokens = float(batch.response_mask.sum())
    train_tokens = gen_tokens + sum(len(p) for p in batch.prompts)
    timing["timing_s/step"] = time.perf_counter() - done.started
    metrics.update(timing)
    metrics.update({"perf/rollout_tokens_per_s": gen_tokens / max(timing["timing_s/gen"], 1e-9),
                    "perf/train_tokens_per_s": train_tokens / timing["timing_s/update_actor"],
                    "perf/weight_sync_bytes": float(done.payload.nbytes),
                    "perf/trainer_idle_fraction": trainer_idle_fraction(timing)})
    return metrics


def trainer_idle_fraction(timing: dict) -> float:
    """1 - (old log-probs + update) / step: the share of the step the trainer ranks wait (for samples, the
    push, the log), in every mode; 0 when the step time is not known."""
    step = timing.get("timing_s/step", 0.0)
    busy = timing.get("timing_s/old_log_prob", 0.0) + timing.get("timing_s/update_actor", 0.0)
    return max(0.0, 1.0 - busy / step) if step > 0 else 0.0

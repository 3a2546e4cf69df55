"""``glm5 rl``: the GRPO / PPO driver loop. It reads top to bottom: the step's samples (prompts →
rollout token ids + log-probs → rewards, DAPO dynamic sampling → the padded batch; with
``trainer.off_policy_steps=1`` all of that for the next step runs in a background thread, started here,
while this thread drives the trainer, ``rl.schedule.step_source``) → old / reference log-probs
(and values) on the trainer → rollout correction (IcePop) → advantages → policy update → push the
adapter to the rollout engines. With ``rollout.colocate.enable`` each generation phase is one
``rl.schedule.colocate.Colocation.phase`` (trainer offload → wake → push → generate → sleep → restore) and the
adapter push waits for it.

``run(cfg)`` takes a plain ``RLConfig`` (Hydra stops at the entry point, ``recipes.cli``).
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

import torch

from glm5_mcore.training.checkpointing import SaveSchedule, refuse_restart_over
from glm5_mcore.training.resume import claim_run_dir, guard_resume
from glm5_mcore.training.run_log import RunLogger
from rl.train import algos
from rl.schedule import shaping
from rl.schedule.async_source import AsyncSource
from rl.train.batch import RolloutBatch
from rl.schedule.colocate import Colocation
from rl.config import RLConfig, run_settings
from rl.tasks.episodes import tool_metrics
from rl.logger import CONSOLE_KEYS
from rl.tasks.rewards import RewardScorer
from rl.schedule.step_source import StepSource
from rl.train.routing import index_metrics, router_metrics
from rl.rollout.base import Request, SamplingParams, sample_seed
from rl.tasks.prompts import load_prompts
from rl.validate import preflight, rollout_logprob_check


@contextmanager
def _timer(timing: dict, key: str):
    t0 = time.perf_counter()
    yield
    timing[f"timing_s/{key}"] = time.perf_counter() - t0


def make_batch(prompts, results, n: int) -> RolloutBatch:
    """The padded batch; observation tokens of tool episodes are out of ``response_mask``."""
    from rl.tasks.episodes import apply_masks

    batch = RolloutBatch.build([p.ids for p in prompts for _ in range(n)], [r.response_ids for r in results],
                               [r.logprobs for r in results], [j for j, _ in enumerate(prompts) for _ in range(n)])
    apply_masks(batch, results)
    if results and all(getattr(r, "routes", None) is not None for r in results):
        batch.routes = [r.routes for r in results]  # R3 (rl.train.routing)
    if any(getattr(r, "index_topk", None) is not None for r in results):
        batch.index_topk = [r.index_topk for r in results]
    return batch


def fill_log_probs(batch: RolloutBatch, outputs: list[dict]) -> None:
    """Put the trainer ranks' old / ref log-probs and values ([n, R] rows) into ``batch``."""
    for key in ("old_log_probs", "ref_log_probs", "values"):
        rows = {}
        for out in outputs:
            if len(out[key]):
                for i, row in zip(out["rows"], out[key]):
                    rows[i] = row[: len(batch.responses[i])]
        if rows:
            batch.set_rows(key, rows)


class Rewards:
    """The samples' rewards (``rl.tasks.rewards.RewardScorer``); ``metrics`` sums ``reward/timeouts`` and
    ``reward/errors`` since the last ``take_metrics``, ``events`` names the failed samples."""

    def __init__(self, cfg: RLConfig, tokenizer):
        self.scorer, self.tok = RewardScorer(cfg.reward), tokenizer
        self.metrics = {"reward/timeouts": 0.0, "reward/errors": 0.0}
        self.events: list[str] = []

    def __call__(self, prompts, results, n: int) -> torch.Tensor:
        rows = [p for p in prompts for _ in range(n)]
        text = [self.tok.decode(r.response_ids, skip_special_tokens=True) for r in results]
        scores, counts, events = self.scorer.score([p.data_source for p in rows], text,
                                                   [p.ground_truth for p in rows], [p.extra for p in rows])
        for k, v in counts.items():
            self.metrics[k] += v
        self.events += events
        return torch.tensor(scores)

    def take_metrics(self) -> dict:
        out, self.metrics = self.metrics, {k: 0.0 for k in self.metrics}
        return out

    def close(self) -> None:
        self.scorer.close()


def run(cfg: RLConfig, record: Optional[Callable[[], None]] = None) -> dict:
    """Train; returns {"history": per-step metrics, "val": [(step, reward)], "state": ...}. ``record`` runs
    once every check passed and ``trainer.out`` is claimed, before Ray starts (the entry point saves the
    job's config there)."""
    from transformers import AutoTokenizer

    from rl.cluster.ray_jobs import check_resources, resources_needed, start_ray
    from rl.cluster.workers import RolloutPool, TrainerGroup

    if not (Path(cfg.model.hf_dir) / "config.json").is_file():
        raise FileNotFoundError(f"model.hf_dir={cfg.model.hf_dir}: no config.json there (a tiny one: "
                                f"glm5 tiny --out {cfg.model.hf_dir})")
    tok = AutoTokenizer.from_pretrained(cfg.model.hf_dir)
    d = cfg.data
    train = load_prompts(d.train, tok, chat_template=d.chat_template, max_tokens=d.max_prompt_tokens,
                         toy_size=d.toy_size, seed=d.seed, columns=d.columns)
    val = load_prompts(d.val, tok, chat_template=d.chat_template, max_tokens=d.max_prompt_tokens,
                       toy_size=d.val_prompts, seed=d.seed + 1, columns=d.columns)[: d.val_prompts]
    stop_ids = preflight(cfg, tok, {"data.train": train, "data.val": val})  # before the folder and Ray
    settings = run_settings(cfg)
    claim_run_dir(cfg.trainer.out, "rl", [cfg.model.hf_dir, cfg.model.ckpt, d.train, d.val])
    if cfg.trainer.resume:  # refuse changed settings before Ray starts
        guard_resume(cfg.trainer.out, settings, cfg.trainer.allow_resume_mismatch, "trainer")
    else:
        refuse_restart_over(cfg.trainer.out, "trainer")
    if record is not None:
        record()
    r = cfg.rollout
    sampling = SamplingParams(r.temperature, r.top_p, r.max_new_tokens, stop_ids)
    rewards = Rewards(cfg, tok)  # its worker processes start after every refusal above
    start_ray(cfg.ray.address, cfg.ray.num_cpus, int(resources_needed(cfg)["CPU"]))
    if not cfg.ray.address:  # a local cluster cannot grow: what it lacks now, it lacks forever
        check_resources(cfg)
    trainers = TrainerGroup(cfg)
    try:
        coloc = Colocation.start(cfg, trainers, lambda: RolloutPool(cfg, trainers.pg)) if r.colocate.enable else None
        rollouts = coloc.rollouts if coloc is not None else RolloutPool(cfg)
    except BaseException:
        trainers.shutdown()
        raise
    phase = coloc.phase if coloc is not None else (lambda what="generate": nullcontext())  # rl.schedule.colocate
    placement = {"trainer": trainers.nodes(), "engines": rollouts.nodes()}  # Ray node ids, rank / actor order
    state = (trainers.first("restore", cfg.trainer.out) if cfg.trainer.resume else None) or {
        "step": 0, "epoch": 0, "cursor": 0, "kl_coef": cfg.algorithm.kl_ctrl.kl_coef}
    state["settings"] = settings
    resume_payload = state.pop("rollout_adapter", None)
    kl_ctrl = algos.kl_controller(cfg)
    kl_ctrl.value = state["kl_coef"]
    log = RunLogger(cfg.wandb, cfg.trainer.out, asdict(cfg), steps=cfg.trainer.steps, start_step=state["step"],
                    progress=cfg.trainer.progress, desc="rl", console_keys=CONSOLE_KEYS)
    if state["step"]:
        log.note(f"resuming {cfg.trainer.out} at step {state['step']} (a new trainer.out starts over)")
    saves = SaveSchedule(cfg.trainer.save_every, state["step"])
    vals: list[tuple[int, float]] = []

    def build(prompts, results):
        batch = make_batch(prompts, results, r.n)
        return batch, (shaping.mask_truncated(batch, results) if cfg.algorithm.mask_truncated_responses else {})

    if cfg.trainer.max_staleness:
        source = AsyncSource(cfg, train, rollouts, sampling, rewards, state, build=build)
        if source.resumed:
            log.note(f"resuming with {source.resumed} prompt group(s) that were buffered or being generated at the "
                     "checkpoint: regenerated first, from their seeds, under the resumed adapter")
    else:
        source = StepSource(cfg, train, rollouts, sampling, rewards, state, resume_payload, build=build)
    push = coloc.push if coloc is not None else source.push  # colocated: held for the next wake-up

    def save() -> None:
        if cfg.trainer.max_staleness:
            state["async"] = source.snapshot()  # the groups admitted and not trained: regenerated on resume
        trainers.call("save", cfg.trainer.out, state["step"], dict(state), rollout_adapter=source.inflight_payload)
        saves.done(state["step"])

    def evaluate() -> float:
        source.settle()  # the engines free, with the newest adapter
        reqs = [Request((p.index, 0), p.ids, sample_seed(cfg.trainer.seed + 1, state["step"], p.index, 0))
                for p in val]
        with phase("evaluate"):
            return float(rewards(val, rollouts.generate(reqs, sampling), 1).mean())

    try:
        (coloc.push if coloc is not None else rollouts.sync)(trainers.first("export_adapter", state["step"]))
        if val and cfg.trainer.eval_every and state["step"] == 0:
            vals.append((0, evaluate()))
            log.log_eval(0, {"val/reward": vals[-1][1]})
            log.note(f"step 0: held-out reward {vals[-1][1]:.3f}")
        while state["step"] < cfg.trainer.steps:
            step, timing, t_step = state["step"], {}, time.perf_counter()
            with phase():
                got = source.take(step, state)
            if coloc is not None:
                got.metrics.update(coloc.metrics(coloc.phases - 1))
            timing["timing_s/gen"] = got.metrics.pop("timing_s/gen")
            batch, trunc = got.batch
            batch.scores = got.scores
            got.metrics.update(trunc)
            got.metrics.update(rollout_logprob_check(batch, step, r.engine))
            if got.metrics["rollout/nonfinite_logprob_fraction"]:
                log.note(f"step {step + 1}: {got.metrics['rollout/nonfinite_logprob_fraction']:.1%} of the response "
                         "tokens have non-finite rollout log-probs (masked out of the loss)")
            with _timer(timing, "old_log_prob"):
                outs = trainers.call("compute_log_probs", batch)
                fill_log_probs(batch, outs)
            metrics = algos.rollout_correction(cfg, batch)
            metrics.update(got.metrics)
            metrics.update(router_metrics(outs))
            metrics.update(index_metrics(outs))
            metrics.update(algos.compute_advantages(cfg, batch, kl_ctrl.value))
            metrics.update(algos.data_metrics(batch))
            with _timer(timing, "update_actor"):
                metrics.update(trainers.call("update", batch, step)[0])
            state["step"] += 1
            with _timer(timing, "weight_sync"):
                payload = trainers.first("export_adapter", state["step"])
                push(payload)
            if cfg.algorithm.use_kl_in_reward:
                kl_ctrl.update(metrics.get("actor/reward_kl_penalty", 0.0), batch.size)
                state["kl_coef"] = kl_ctrl.value
            for g, index in getattr(source, "last_dropped", []):
                log.note(f"step {state['step']}: prompt {index} (generation batch {g}) dropped: a sample held a token "
                         f"more than trainer.max_staleness={cfg.trainer.max_staleness} versions old")
            for why in metrics.pop("skip_reasons", []):
                log.note(f"step {state['step']}: update skipped ({why})")
            events, rollouts.events = rollouts.events, []  # a gather in flight may add more
            events, rewards.events = events + rewards.events, []
            for event in events:
                log.note(f"step {state['step']}: {event}")
            metrics["rollout/actor_restarts"] = float(rollouts.restarts)
            metrics["rollout/samples"] = float(len({(res.round, res.key) for res in got.results}))
            metrics.update(tool_metrics(got.results))
            gen_tokens = float(batch.response_mask.sum())
            train_tokens = gen_tokens + sum(len(p) for p in batch.prompts)
            timing["timing_s/step"] = time.perf_counter() - t_step
            metrics.update(timing)
            metrics.update({"perf/rollout_tokens_per_s": gen_tokens / max(timing["timing_s/gen"], 1e-9),
                            "perf/train_tokens_per_s": train_tokens / timing["timing_s/update_actor"],
                            "perf/weight_sync_bytes": float(payload.nbytes)})
            if val and cfg.trainer.eval_every and state["step"] % cfg.trainer.eval_every == 0:
                metrics["val/reward"] = evaluate()
                vals.append((state["step"], metrics["val/reward"]))
            log.log(state["step"], metrics)
            if saves.due(state["step"]):
                save()
            stop = cfg.trainer.stop_at_reward
            if stop is not None and vals and vals[-1][0] == state["step"] and vals[-1][1] >= stop:
                log.note(f"step {state['step']}: held-out reward {vals[-1][1]:.3f} >= {stop}, stopping")
                break
        if saves.final_due(state["step"]):  # the last step (or the early stop), whatever save_every
            save()
        if cfg.trainer.max_staleness and source.outstanding():
            log.note(f"run ended with {source.outstanding()} prompt group(s) buffered or being generated, not "
                     "trained; the checkpoint lists them, so a longer run resumed from it regenerates them first")
    finally:
        source.close()
        rewards.close()
        log.close()
        rollouts.shutdown()
        trainers.shutdown()
    return {"history": log.history, "val": vals, "state": state,
            "colocate": coloc.trace if coloc is not None else None, "placement": placement}

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
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from glm5_mcore.training.resume import SaveSchedule, claim_run_dir, guard_resume, refuse_restart_over
from glm5_mcore.training.run_log import RunLogger
from rl.config import RLConfig, run_settings
from rl.metrics import CONSOLE_KEYS, StepDone, step_metrics, step_notes
from rl.rollout.base import Request, SamplingParams, sample_seed
from rl.schedule import shaping
from rl.schedule.async_source import AsyncSource
from rl.schedule.colocate import Colocation
from rl.schedule.step_source import StepSource
from rl.tasks.prompts import load_prompts
from rl.tasks.step_rewards import Rewards
from rl.train import algos
from rl.train.batch import fill_log_probs, make_batch
from rl.train.routing import index_metrics, router_metrics
from rl.validate import preflight, rollout_logprob_check


def run(cfg: RLConfig, record: Optional[Callable[[], None]] = None) -> dict:
    """Train; returns {"history": per-step metrics, "val": [(step, reward)], "state": ...}. ``record`` runs
    once every check passed and ``trainer.out`` is claimed, before Ray starts (the entry point saves the
    job's config there)."""
    tok, train, val, sampling = prompt_sets(cfg)  # read and checked before the run folder and Ray
    settings = claim(cfg, record)
    rewards = Rewards(cfg, tok)  # its worker processes start after every refusal above
    cluster = Cluster.start(cfg)
    state = restore(cfg, cluster, settings)
    kl_ctrl = algos.kl_controller(cfg)
    kl_ctrl.value = state["kl_coef"]
    log = RunLogger(cfg.wandb, cfg.trainer.out, asdict(cfg), steps=cfg.trainer.steps, start_step=state["step"],
                    progress=cfg.trainer.progress, desc="rl", console_keys=CONSOLE_KEYS)
    if state["step"]:
        log.note(f"resuming {cfg.trainer.out} at step {state['step']} (a new trainer.out starts over)")
    saves, vals = SaveSchedule(cfg.trainer.save_every, state["step"]), []
    source = sample_source(cfg, train, cluster, sampling, rewards, state, log)
    push = cluster.coloc.push if cluster.coloc is not None else source.push  # colocated: held for the next wake-up

    def evaluate() -> float:
        return held_out_reward(cfg, cluster, source, rewards, val, sampling, state["step"])

    def save() -> None:
        if cfg.trainer.max_staleness:
            state["async"] = source.snapshot()  # the groups admitted and not trained: regenerated on resume
        cluster.trainers.call("save", cfg.trainer.out, state["step"], dict(state),
                              rollout_adapter=source.inflight_payload)
        saves.done(state["step"])

    try:
        cluster.push_first(cluster.trainers.first("export_adapter", state["step"]))
        if val and cfg.trainer.eval_every and state["step"] == 0:
            vals.append((0, evaluate()))
            log.log_eval(0, {"val/reward": vals[-1][1]})
            log.note(f"step 0: held-out reward {vals[-1][1]:.3f}")
        while state["step"] < cfg.trainer.steps:
            done = train_step(cfg, cluster, source, kl_ctrl, push, state)
            for note in step_notes(cfg, state["step"], done, source, cluster.rollouts, rewards):
                log.note(note)
            metrics = step_metrics(done, cluster.rollouts.restarts)
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
        cluster.shutdown()
    return {"history": log.history, "val": vals, "state": state,
            "colocate": cluster.coloc.trace if cluster.coloc is not None else None, "placement": cluster.placement}


def prompt_sets(cfg: RLConfig) -> tuple:
    """(tokenizer, train prompts, held-out prompts, sampling parameters), with every check that needs the
    tokenizer and the model config done (``rl.validate.preflight``)."""
    from transformers import AutoTokenizer

    if not (Path(cfg.model.hf_dir) / "config.json").is_file():
        raise FileNotFoundError(f"model.hf_dir={cfg.model.hf_dir}: no config.json there (a tiny one: "
                                f"glm5 tiny --out {cfg.model.hf_dir})")
    tok = AutoTokenizer.from_pretrained(cfg.model.hf_dir)
    d, r = cfg.data, cfg.rollout
    train = load_prompts(d.train, tok, chat_template=d.chat_template, max_tokens=d.max_prompt_tokens,
                         toy_size=d.toy_size, seed=d.seed, columns=d.columns)
    val = load_prompts(d.val, tok, chat_template=d.chat_template, max_tokens=d.max_prompt_tokens,
                       toy_size=d.val_prompts, seed=d.seed + 1, columns=d.columns)[: d.val_prompts]
    stop_ids = preflight(cfg, tok, {"data.train": train, "data.val": val})
    return tok, train, val, SamplingParams(r.temperature, r.top_p, r.max_new_tokens, stop_ids)


def claim(cfg: RLConfig, record: Optional[Callable[[], None]]) -> dict:
    """``trainer.out`` claimed for this run (``claim_run_dir``: never an input's folder), a resume's settings
    checked against the saved ones, a restart over an earlier run refused; then ``record()``. Returns the
    run's settings (``rl.config.run_settings``)."""
    settings = run_settings(cfg)
    claim_run_dir(cfg.trainer.out, "rl", [cfg.model.hf_dir, cfg.model.ckpt, cfg.data.train, cfg.data.val])
    if cfg.trainer.resume:
        guard_resume(cfg.trainer.out, settings, cfg.trainer.allow_resume_mismatch, "trainer")
    else:
        refuse_restart_over(cfg.trainer.out, "trainer")
    if record is not None:
        record()
    return settings


@dataclass
class Cluster:
    """The trainer ranks (``rl.cluster.trainer_group.TrainerGroup``), the rollout engines
    (``rl.cluster.rollout_pool.RolloutPool``) and, with ``rollout.colocate.enable``, the phases that
    time-share the trainer's GPUs with the engines (``rl.schedule.colocate.Colocation``)."""

    trainers: Any
    rollouts: Any
    coloc: Optional[Colocation]
    placement: dict
    """Ray node ids, {"trainer": [rank order], "engines": [actor order]}."""

    @staticmethod
    def start(cfg: RLConfig) -> "Cluster":
        from rl.cluster.ray_jobs import check_resources, resources_needed, start_ray
        from rl.cluster.rollout_pool import RolloutPool
        from rl.cluster.trainer_group import TrainerGroup

        start_ray(cfg.ray.address, cfg.ray.num_cpus, int(resources_needed(cfg)["CPU"]))
        if not cfg.ray.address:  # a local cluster cannot grow: what it lacks now, it lacks forever
            check_resources(cfg)
        trainers = TrainerGroup(cfg)  # its ranks build and load while the engines start (separate engines)
        try:
            if cfg.rollout.colocate.enable:  # the engines start on memory the ready trainer lends them
                coloc = Colocation.start(cfg, trainers.ready(), lambda: RolloutPool(cfg, trainers.pg))
                rollouts = coloc.rollouts
            else:
                coloc, rollouts = None, RolloutPool(cfg)
                trainers.ready()
            return Cluster(trainers, rollouts, coloc, {"trainer": trainers.nodes(), "engines": rollouts.nodes()})
        except BaseException:
            trainers.shutdown()
            raise

    def phase(self, what: str = "generate"):
        """The context of an engine phase: colocated, trainer offloaded → engines awake (``Colocation.phase``)."""
        return self.coloc.phase(what) if self.coloc is not None else nullcontext()

    def push_first(self, payload) -> None:
        """The run's first adapter to the engines (colocated: held for the first wake-up)."""
        (self.coloc.push if self.coloc is not None else self.rollouts.sync)(payload)

    def shutdown(self) -> None:
        self.rollouts.shutdown()
        self.trainers.shutdown()


def restore(cfg: RLConfig, cluster: Cluster, settings: dict) -> dict:
    """The run's state: the trainer's saved one when resuming (step, epoch, prompt cursor, KL coefficient, the
    adapter the engines held: ``rollout_adapter``), else step 0."""
    state = (cluster.trainers.first("restore", cfg.trainer.out) if cfg.trainer.resume else None) or {
        "step": 0, "epoch": 0, "cursor": 0, "kl_coef": cfg.algorithm.kl_ctrl.kl_coef}
    state["settings"] = settings
    return state


def sample_source(cfg: RLConfig, train, cluster: Cluster, sampling, rewards, state: dict, log):
    """Where each step's samples come from: ``AsyncSource`` with ``trainer.max_staleness``, else
    ``StepSource`` (synchronous, or one step ahead with ``trainer.off_policy_steps=1``)."""
    def build(prompts, results):
        batch = make_batch(prompts, results, cfg.rollout.n)
        return batch, (shaping.mask_truncated(batch, results) if cfg.algorithm.mask_truncated_responses else {})

    resume_payload = state.pop("rollout_adapter", None)
    if not cfg.trainer.max_staleness:
        return StepSource(cfg, train, cluster.rollouts, sampling, rewards, state, resume_payload, build=build)
    source = AsyncSource(cfg, train, cluster.rollouts, sampling, rewards, state, build=build)
    if source.resumed:
        log.note(f"resuming with {source.resumed} prompt group(s) that were buffered or being generated at the "
                 "checkpoint: regenerated first, from their seeds, under the resumed adapter")
    return source


def held_out_reward(cfg: RLConfig, cluster: Cluster, source, rewards, val, sampling, step: int) -> float:
    """The mean reward of one greedy-seeded sample per held-out prompt, on the engines settled with the
    newest adapter."""
    source.settle()
    reqs = [Request((p.index, 0), p.ids, sample_seed(cfg.trainer.seed + 1, step, p.index, 0)) for p in val]
    with cluster.phase("evaluate"):
        return float(rewards(val, cluster.rollouts.generate(reqs, sampling), 1).mean())


@contextmanager
def _timer(timing: dict, key: str):
    t0 = time.perf_counter()
    yield
    timing[f"timing_s/{key}"] = time.perf_counter() - t0


def train_step(cfg: RLConfig, cluster: Cluster, source, kl_ctrl, push, state: dict) -> StepDone:
    """One step: its samples (``source.take``) → old / reference log-probs (and values) on the trainer →
    rollout correction (IcePop) → advantages → policy update → the new adapter pushed; ``state["step"]``
    advanced and the KL coefficient adapted."""
    step, timing, t_step = state["step"], {}, time.perf_counter()
    with cluster.phase():
        got = source.take(step, state)
    if cluster.coloc is not None:
        got.metrics.update(cluster.coloc.metrics(cluster.coloc.phases - 1))
    timing["timing_s/gen"] = got.metrics.pop("timing_s/gen")
    batch, trunc = got.batch
    batch.scores = got.scores
    got.metrics.update(trunc)
    got.metrics.update(rollout_logprob_check(batch, step, cfg.rollout.engine))
    with _timer(timing, "old_log_prob"):
        outs = cluster.trainers.call("compute_log_probs", batch)
        fill_log_probs(batch, outs)
    metrics = algos.rollout_correction(cfg, batch)
    metrics.update(got.metrics)
    metrics.update(router_metrics(outs))
    metrics.update(index_metrics(outs))
    metrics.update(algos.compute_advantages(cfg, batch, kl_ctrl.value))
    metrics.update(algos.data_metrics(batch))
    with _timer(timing, "update_actor"):
        metrics.update(cluster.trainers.call("update", batch, step)[0])
    state["step"] += 1
    with _timer(timing, "weight_sync"):
        payload = cluster.trainers.first("export_adapter", state["step"])
        push(payload)
    if cfg.algorithm.use_kl_in_reward:
        kl_ctrl.update(metrics.get("actor/reward_kl_penalty", 0.0), batch.size)
        state["kl_coef"] = kl_ctrl.value
    return StepDone(metrics, got, batch, payload, timing, t_step)

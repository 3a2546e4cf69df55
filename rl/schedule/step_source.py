"""Where each step's samples come from: ``StepSource`` gathers a step — draws its prompts, generates,
scores, applies DAPO's dynamic sampling (``rl.schedule.shaping``: refill rounds until the batch is full) — and,
with ``trainer.off_policy_steps=1``, gathers step n+1 in a background thread while the trainer works
on step n (verl's one-step-off-policy recipe): the engines generate, the driver scores and refills
step n+1's batch, all while the trainer computes log-probs, updates and exports the adapter; the
driver's main thread only waits for the trainer. A round decodes on the engines' stream where the run has
one (``rl.cluster.rollout_pool.engine_streams``: the HF engine's continuous slots, drained until every
request of the round is back, so a short response frees its slot for a queued one instead of decoding
filler until the batch's longest ends), else as one static ``generate`` job.

Everything that decides a sample is fixed by the step, not by timing: prompts come from the epoch
stream in step order (a step's refill rounds before the next step's first round: one gather at a
time), seeds from (step, round, prompt, sample), and every round of step s is generated with adapter
version s - off_policy_steps. ``push`` (the driver's weight sync after an update) keeps that rule: with
overlap the new adapter is queued on the engines when the gather in flight has finished its last
round (at once when none is in flight), never blocking the driver. The version travels with each
sample (``rollout/staleness`` = trainer version − sample version). A checkpoint written while step
s+1 is in flight keeps the adapter it is generated with (``inflight_payload``), so a resumed run
regenerates that batch exactly.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Optional

import torch

from rl.rollout.base import Request, push_metrics, sample_seed
from rl.schedule.shaping import GroupFilter, shape_scores
from rl.tasks.prompts import next_prompts


@dataclass
class StepSamples:
    prompts: list
    results: list
    scores: torch.Tensor
    """[B] rewards after the overlong penalty (what the advantages use)."""
    versions: torch.Tensor
    """[B] adapter version each sample was generated with."""
    metrics: dict
    batch: Optional[object] = None
    """What ``build(prompts, results)`` made in the gather (the driver's padded ``RolloutBatch``)."""


def length_metrics(trained: list[int], generated: list[int]) -> dict:
    """Response lengths (tokens) of the batch, ``rollout/length_trained/{mean,p90}``, and of every response the
    engines finished since the previous step, ``rollout/length_generated/{mean,p90}`` (DAPO's filtered groups
    included; async: every finished sample, its group complete or still waiting for its long one). A trained
    distribution shorter than the generated one is a length bias of what is trained. An empty side is left out."""
    out = {}
    for side, lengths in (("trained", trained), ("generated", generated)):
        if lengths:
            t = torch.tensor(lengths, dtype=torch.float32)
            out.update({f"rollout/length_{side}/mean": float(t.mean()),
                        f"rollout/length_{side}/p90": float(torch.quantile(t, 0.9))})
    return out


def engine_metrics(rollouts) -> dict:
    """``rollout/engine_occupancy``: the engines' live rows / slots, time-averaged since the last step
    (``RolloutPool.occupancy``), and ``rollout/push_*`` of the adapter pushes since then (``rollout.base.push_metrics``);
    {} for a pool or engine that does not measure them."""
    occ = rollouts.occupancy() if hasattr(rollouts, "occupancy") else None
    out = push_metrics(rollouts.pushes()) if hasattr(rollouts, "pushes") else {}
    return out if occ is None else {**out, "rollout/engine_occupancy": float(occ)}


class StepSource:
    """``take(step, state)`` → the step's ``StepSamples``; ``push(payload)`` after each update;
    ``settle()`` before generating anything else on the engines (evaluation); ``close()`` at the end.
    ``build``: an optional ``(prompts, results) -> batch`` run inside the gather (off the driver's
    critical path with overlap)."""

    def __init__(self, cfg, train: list, rollouts, sampling, rewards, state: dict, resume_payload=None,
                 build=None):
        self.cfg, self.train, self.rollouts, self.sampling, self.rewards = cfg, train, rollouts, sampling, rewards
        self.build = build
        self.pos = {"epoch": state["epoch"], "cursor": state["cursor"]}
        self.resume_payload = resume_payload
        self.overlap = cfg.trainer.off_policy_steps > 0
        self._ahead: Optional[tuple[int, Future, object]] = None  # (step, gather, adapter) in flight
        self._pending = None  # an adapter pushed while a gather was in flight
        self._busy = False
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="glm5-rollout") if self.overlap else None
        self.streams = bool(getattr(rollouts, "streams", False))
        """Decode on the engines' stream (``rl.cluster.rollout_pool.engine_streams``: the HF engine's default in
        every mode), else ``generate`` jobs."""

    @property
    def inflight_payload(self):
        """The adapter the in-flight next step is generated with (saved with checkpoints), or None."""
        return self._ahead[2] if self._ahead is not None else None

    # ------------------------------------------------------------------ the driver's calls
    def take(self, step: int, state: dict) -> StepSamples:
        """Step ``step``'s samples; advances ``state``'s data position past every prompt they used. With
        overlap, starts gathering step + 1 before returning. ``metrics["timing_s/gen_wait"]``: how long
        the caller waited for the samples."""
        t0 = time.perf_counter()
        if self._ahead is not None:
            if self._ahead[0] != step:
                raise RuntimeError(f"step {step} asked for while step {self._ahead[0]} is in flight")
            got = self._ahead[1].result()
        else:
            got = self._first(step)
        self._ahead = None
        state["epoch"], state["cursor"] = self.pos["epoch"], self.pos["cursor"]
        if self.overlap and step + 1 < self.cfg.trainer.steps:
            with self._lock:
                self._busy = True
            self._ahead = (step + 1, self._pool.submit(self._gather, step + 1), self.rollouts.payload)
        got.metrics["timing_s/gen_wait"] = time.perf_counter() - t0
        got.metrics.update({"rollout/reprefill_tokens": 0.0, **engine_metrics(self.rollouts)})
        return got

    def push(self, payload) -> None:
        """Put the adapter the trainer just exported on the engines. Synchronous: loaded before this
        returns. Overlap: queued on the engines (``RolloutPool.sync(wait=False)``) at once, or — while a
        gather is in flight — as soon as it has collected its last round."""
        if not self.overlap:
            self.rollouts.sync(payload)
            return
        with self._lock:
            if self._busy:
                self._pending = payload
            else:
                self.rollouts.sync(payload, wait=False)

    def settle(self) -> None:
        """Wait for the gather in flight (its samples stay for ``take``), so the engines are free and hold
        the newest pushed adapter (queued loads are waited for by the next ``RolloutPool.submit``)."""
        if self._ahead is not None:
            wait([self._ahead[1]])

    def close(self) -> None:
        """Let a gather in flight finish (its actors must not be shut down under it), then stop the thread."""
        if self._ahead is not None:
            wait([self._ahead[1]])
            self._ahead = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------ gathering
    def _first(self, step: int) -> StepSamples:
        """``step`` gathered here when nothing is in flight: the first step, or a resumed run's step whose
        batch was in flight at the checkpoint (regenerated with the adapter saved for it)."""
        if self.resume_payload is not None and self.overlap:
            current = self.rollouts.payload
            self.rollouts.sync(self.resume_payload)
            with self._lock:
                self._busy, self._pending = True, current  # the current adapter goes back after the gather
        self.resume_payload = None
        return self._gather(step)

    def _gather(self, step: int) -> StepSamples:
        try:
            return self._rounds(step)
        finally:
            with self._lock:
                self._busy = False
                payload, self._pending = self._pending, None
                if payload is not None:
                    self.rollouts.sync(payload, wait=False)

    def _requests(self, prompts, step: int, rnd: int) -> list[Request]:
        seed = self.cfg.trainer.seed + 7919 * rnd
        return [Request((p.index, k), p.ids, sample_seed(seed, step, p.index, k))
                for p in prompts for k in range(self.cfg.rollout.n)]

    def _generate(self, requests: list[Request]) -> tuple[list, int]:
        """``requests`` under the adapter the engines hold: (results in request order, its version). On the
        engines' stream (``RolloutPool.streams``: every request submitted at once, polled until each is back; a
        slot is refilled the moment its response ends, so nothing decodes past its own end) or as one
        ``submit`` / ``collect`` job (``rollout.engine_kwargs.stream=false``: the HF engine's static batches)."""
        if not self.streams:
            job = self.rollouts.submit(requests, self.sampling)
            return self.rollouts.collect(job), job["version"]
        self.rollouts.settle_loads()  # a queued push (one step off) has loaded; a failed one stops here
        version = self.rollouts.payload.version if self.rollouts.payload is not None else -1
        self.rollouts.stream_submit(requests, self.sampling)
        got: dict = {}
        while len(got) < len(requests):
            for res in self.rollouts.stream_poll(0.5):
                if res.version is not None and res.version != version:
                    raise RuntimeError(f"sample {res.key} was generated with adapter v{res.version}, the step's is "
                                       f"v{version}: a push reached the engines mid-step")
                got[res.key] = res
        return [got[r.key] for r in requests], version

    def _rounds(self, step: int) -> StepSamples:
        """Generation rounds of ``step`` until DAPO's filter has the batch (one round without it)."""
        t_start = time.perf_counter()
        n = self.cfg.rollout.n
        fg = self.cfg.algorithm.filter_groups
        filt = GroupFilter(self.cfg.data.prompts_per_step, n, fg.metric, fg.enable)
        versions, t_reward, rnd, shape_m, generated = {}, 0.0, 0, {}, []
        while True:
            prompts = next_prompts(self.train, self.cfg.data.prompts_per_step, self.cfg.data.seed, self.pos)
            results, version = self._generate(self._requests(prompts, step, rnd))
            t0 = time.perf_counter()
            for res in results:
                versions[(rnd, res.key)] = version
                res.round = rnd
                generated.append(len(res.response_ids))
            raw = self.rewards(prompts, results, n)
            lengths = torch.tensor([len(r.response_ids) for r in results])
            shaped, shape_m = shape_scores(self.cfg, raw, lengths)
            filt.add(prompts, results, raw, shaped)
            t_reward += time.perf_counter() - t0
            rnd += 1
            limit = fg.max_num_gen_batches
            if filt.full or not fg.enable or (limit > 0 and rnd >= limit):
                break
            if limit <= 0 and rnd * self.cfg.data.prompts_per_step >= len(self.train):
                raise ValueError(
                    f"algorithm.filter_groups.max_num_gen_batches={limit} (no limit): step {step} drew every prompt "
                    f"of data.train once ({rnd} generation rounds) and kept {len(filt.kept)} of "
                    f"{self.cfg.data.prompts_per_step} groups whose {fg.metric} is not the same for all "
                    f"rollout.n={n} samples, so it would regenerate forever; set max_num_gen_batches > 0 (the step "
                    "is then topped up with uniform groups) or check reward.fn")
        prompts, results, raw, shaped, metrics = filt.take()
        metrics.update(shape_m)
        if hasattr(self.rewards, "take_metrics"):  # rl.tasks.step_rewards.Rewards (tests pass a plain function)
            metrics.update(self.rewards.take_metrics())
        ver = torch.tensor([versions[(r.round, r.key)] for r in results], dtype=torch.float32)
        stale = step - ver
        t0 = time.perf_counter()
        batch = self.build(prompts, results) if self.build is not None else None
        t_build = time.perf_counter() - t0
        metrics.update(length_metrics([len(r.response_ids) for r in results], generated))
        metrics.update({"rollout/staleness": float(stale.mean()), "rollout/staleness_max": float(stale.max()),
                        "timing_s/reward": t_reward, "timing_s/pack": t_build,
                        "timing_s/gen": time.perf_counter() - t_start - t_reward - t_build})
        return StepSamples(prompts, results, shaped, ver, metrics, batch)

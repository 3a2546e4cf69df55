"""The HF engine's continuous decoding (``stream_submit`` / ``stream_poll``, ``rl.rollout.hf_slots``): with fewer
slots than requests every response equals the static-batch engine's (tokens exactly, log-probs to float
rounding), routes and indexer rows included, rows of different lengths sharing each decode forward (a
left-padded cache); finished responses come back before the long ones end and their
slots are refilled; an interrupt hands back every live row, continued to the uninterrupted response; an
adapter loaded under live rows waits for them (no response spans two versions); occupancy is measured."""

import dataclasses
import time

import pytest
import torch

from rl.rollout.base import AdapterPayload, Request, SamplingParams, sample_seed

PARAMS = SamplingParams(temperature=1.5, max_new_tokens=10, seed_per_token=True)


@pytest.fixture(scope="module")
def engine(tiny_dir):
    from rl.rollout.hf_engine import HFRolloutEngine

    return HFRolloutEngine(tiny_dir, max_num_seqs=4, index_row_stride=1)  # every query row past k recorded


def _requests(n_prompts=4, n=3):
    """Prompts of three lengths (several cohorts), ``n`` samples each."""
    return [Request((p, k), [3 + p, 9, 4, 7 + p] * (2 + p % 3), sample_seed(7, 0, p, k))
            for p in range(n_prompts) for k in range(n)]


def _drain(engine, limit=500, deadline_s=120.0):
    polls, t_end = [], time.perf_counter() + deadline_s  # a stuck admission fails below, not after 500 polls
    while engine.slots.has_work() and len(polls) < limit and time.perf_counter() < t_end:
        polls.append(engine.stream_poll(timeout_s=1.0))
    assert not engine.slots.has_work()
    return polls


def _by_key(polls):
    out = {}
    for got in polls:
        for r in got:
            assert r.key not in out, f"{r.key} returned twice"
            out[r.key] = r
    return out


@pytest.mark.parametrize("params", [PARAMS, dataclasses.replace(PARAMS, seed_per_token=False)],
                         ids=["per_token_seed", "running_generator"])
def test_stream_equals_the_batch_engine_with_slot_refill(engine, params):
    """Both samplings: async's per-token seeds, and the synchronous modes' running generator per request (those
    modes decode on the stream by default: the same samples as ``generate``'s static batches)."""
    reqs = _requests()
    whole = {r.key: r for r in engine.generate(reqs, params)}
    engine.stream_submit(reqs, params)
    polls = _drain(engine)
    got = _by_key(polls)
    assert set(got) == set(whole)
    for key, a in whole.items():
        b = got[key]
        assert b.response_ids == a.response_ids and b.finish_reason == a.finish_reason, key
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
        assert b.version == -1
        if a.routes is not None:
            assert b.routes.shape == a.routes.shape and (b.routes == a.routes).all()
        if a.index_topk is not None:
            assert (b.index_topk[0] == a.index_topk[0]).all() and (b.index_topk[1] == a.index_topk[1]).all()
    assert len(polls) > 1  # returned as they finished, not as one batch
    assert engine.slots.prefill_tokens > 0
    assert engine.slots.padded_forwards > 0  # rows of other lengths shared a forward (left-padded cache)


def test_short_responses_come_back_while_long_ones_decode(engine):
    """A forced budget: sample 0 of each prompt is short (2 tokens), the others long (10); with 4 slots the
    short ones return first and the queued requests enter their slots while the long ones still decode."""
    short = {k for k in ((p, 0) for p in range(4))}
    old = engine.response_budget
    engine.response_budget = lambda r, p: 2 if r.key in short else p.max_new_tokens
    try:
        params = SamplingParams(temperature=1.5, max_new_tokens=10, seed_per_token=True, stop_token_ids=())
        engine.stream_submit(_requests(), params)
        first = engine.stream_poll(timeout_s=5.0)
        assert first and {r.key for r in first} <= short and all(len(r.response_ids) == 2 for r in first)
        assert engine.slots.live > 0 and engine.slots.live + len(engine.slots.waiting) == 12 - len(first)
        got = _by_key([first] + _drain(engine))
        assert len(got) == 12
    finally:
        engine.response_budget = old


def test_interrupt_hands_back_every_row_continued_to_the_uninterrupted_response(engine):
    reqs = _requests(2, 2)
    whole = {r.key: r for r in engine.generate(reqs, PARAMS)}
    engine.stream_submit(reqs, PARAMS)
    engine.slots.step(engine.occupancy)  # 1 token each for the admitted rows
    engine.slots.forward(engine.occupancy)
    engine.interrupt()
    cut = engine.stream_poll(timeout_s=5.0)
    assert {r.key for r in cut} == set(whole) and all(r.finish_reason == "interrupted" for r in cut)
    assert not engine.slots.has_work()
    cont = [Request(r.key, q.prompt_ids, q.seed, r.response_ids, r.logprobs) for q, r in
            zip(reqs, sorted(cut, key=lambda r: reqs.index(next(q for q in reqs if q.key == r.key))))]
    engine.stream_submit(cont, PARAMS)
    got = _by_key(_drain(engine))
    for key, a in whole.items():
        assert got[key].response_ids == a.response_ids
        assert got[key].logprobs == pytest.approx(a.logprobs, abs=1e-5)
    assert engine.interrupt() is True and not engine._stream_stop.is_set()  # idle: nothing to stop


@pytest.mark.parametrize("payload", [AdapterPayload(1), None], ids=["adapter", "base"])
def test_an_adapter_loaded_under_live_rows_waits_for_them(engine, payload):
    """``partial_rollout=false``'s guarantee at the engine: rows live at the load finish under the adapter they
    started with (version 0 here), the queued ones start under the new one (version 1; None, the base model:
    -1), and admission resumes once it is installed."""
    engine.payload_version = 0
    reqs = _requests()
    engine.stream_submit(reqs, PARAMS)
    first = engine.slots.step(engine.occupancy)  # one token: 4 rows live, 8 queued
    engine.slots.forward(engine.occupancy)
    live = {r.req.key for c in engine.slots.cohorts for r in c.rows}
    assert live
    engine.load_adapter(payload)  # AdapterPayload(1) has no files: the base model too, as version 1
    assert engine.payload_version == 0 and engine.slots.hold
    got = _by_key([first] + _drain(engine))
    new = payload.version if payload is not None else -1
    assert all(got[k].version == 0 for k in live)
    assert {r.version for r in got.values()} == {0, new} and len(got) == len(reqs)
    assert engine.payload_version == new and not engine.slots.hold


def test_occupancy_is_live_rows_over_slots(engine):
    engine.take_occupancy()
    engine.stream_submit(_requests(), PARAMS)
    _drain(engine)
    occ = engine.take_occupancy()
    assert 0.3 < occ["occupancy"] <= 1.0 and occ["slots"] == 4
    assert engine.take_occupancy()["occupancy"] == pytest.approx(0.0, abs=1e-3)


def test_mixed_sampling_params_in_one_stream_are_refused(engine):
    engine.stream_submit(_requests(1, 1), PARAMS)
    with pytest.raises(ValueError, match="differ from the stream"):
        engine.stream_submit(_requests(1, 1), SamplingParams(max_new_tokens=4, seed_per_token=True))
    _drain(engine)
    torch.manual_seed(0)


def _lengths(n_each: dict) -> list[Request]:
    return [Request((L, i), [5] * L, i) for L, n in n_each.items() for i in range(n)]


def test_prefill_buckets_pad_no_fresh_prompt_to_a_continued_response():
    """An admission of fifteen 3-token prompts and one 130-token continued request: two forwards, not one that
    pads every prompt to 130 (the fully async bench's prefills were 3.1x their real tokens, 44 % of an engine's
    time); neighbouring lengths share a forward; the partition is the cheapest of every contiguous split."""
    import itertools

    from rl.rollout.hf_slots import PREFILL_COST_US, prefill_buckets

    def lens(buckets):
        return [[len(r.prompt_ids) for r in b] for b in buckets]

    assert lens(prefill_buckets(_lengths({3: 15, 130: 1}))) == [[3] * 15, [130]]
    assert lens(prefill_buckets(_lengths({10: 2, 11: 3, 12: 1}))) == [[10, 10, 11, 11, 11, 12]]
    a, b, c = PREFILL_COST_US
    for seed in range(20):
        g = torch.Generator().manual_seed(seed)
        reqs = [Request(i, [5] * int(x), i) for i, x in enumerate(torch.randint(1, 160, (7,), generator=g))]
        got = prefill_buckets(reqs)
        assert sorted(r.key for bkt in got for r in bkt) == list(range(7))
        S = [max(x) for x in lens(got)]
        cost = sum(a + len(bkt) * (b * s + c * s * s) for bkt, s in zip(got, S))
        L = sorted(len(r.prompt_ids) for r in reqs)
        best = min(sum(a + (j - i) * (b * L[j - 1] + c * L[j - 1] ** 2) for i, j in zip((0,) + cuts, cuts + (7,)))
                   for k in range(7) for cuts in itertools.combinations(range(1, 7), k))
        assert cost == pytest.approx(best)

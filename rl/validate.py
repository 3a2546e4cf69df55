"""What an RL run can be refused for before Ray starts (issue 34): each a ``ValueError`` naming the field,
file or setting, instead of a ``ray::Actor.method()`` stack at the first update or generate.

- ``validate(cfg)``: the config alone (run by ``RLConfig.from_dict``): ranges, choices, the trainer layout,
  importable ``reward.fn`` / ``rollout.engine`` / ``rollout.multi_turn.env``, GPU-only flags, the reward and
  tool settings of ``rl.tasks.checks`` (finite timeouts and scores, the code tool's ``env_kwargs`` and this
  machine's isolation); then
- ``check_config(cfg)``: the config alone (run by ``validate``): ``actor.policy_loss`` is one of
  verl's registered losses, R3 is not combined with tool episodes, DAPO's shaping (``filter_groups``,
  ``overlong_buffer``: ``penalty_factor`` >= 0), ``ray.wait_timeout_s`` finite and > 0,
  ``rollout.engine_kwargs`` are keys the engine takes (``RolloutEngine.check_kwargs``).
- ``preflight(cfg, tokenizer, prompt_sets)``: with the tokenizer and the model config (run by
  ``rl.driver.run`` before the run folder is claimed): the model config the trainer ranks would build
  (a Megatron-LM / Bridge checkpoint checked against ``model.hf_dir``), MTP weights for ``actor.mtp_loss_scale``
  / ``actor.mtp_accept``, the trainer layout against the model (heads, experts, expert width, layers), stop
  tokens (strings known to the tokenizer, ids inside the vocabulary), the tool sandbox's line for the run's log
  (printed), and
  the longest prompt + ``rollout.max_new_tokens`` inside the model's context and inside one micro-batch
  (``actor.micro_batch_tokens``, ``actor.log_prob_micro_batch_tokens``). Returns the stop ids.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

from glm5_mcore.checkpoint.layout import serving_dir
from glm5_mcore.mcore_settings import token_multiple_of
from glm5_mcore.training.loop import OptimCfg, check_optimizer
from rl.cluster.engine_placement import check as check_engine_layout
from rl.train.cp import cp_unit
from rl.tasks.checks import check_multi_turn, check_reward, check_timeout, tool_lines
from rl.train.verl_import import prepare as prepare_verl
from rl.tasks.proc_pool import resolve
from rl.tasks.prompts import token_ids
from rl.tasks.rewards import fn_path

prepare_verl()  # verl's math without Ray where Ray is not installed (the lent GPU image)

ADV_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "gae")
KL_TYPES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")
AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def check_async(c) -> None:
    """``trainer.max_staleness`` (``rl.schedule.async_source``): the settings it cannot serve, refused in one line."""
    t, r, a = c.trainer, c.rollout, c.algorithm
    if isinstance(t.max_staleness, bool) or t.max_staleness < 0:
        raise ValueError(f"trainer.max_staleness={t.max_staleness!r}: an integer >= 0 (0: off)")
    if not t.max_staleness:
        return
    why = [(t.off_policy_steps, "trainer.off_policy_steps=1 (max_staleness already generates ahead; set it to 0)"),
           (r.colocate.enable, "rollout.colocate.enable=true (colocated engines and trainer share the GPUs, so "
                               "generation cannot run while the trainer updates)"),
           (r.multi_turn.enable and t.partial_rollout,
            "rollout.multi_turn.enable=true with trainer.partial_rollout=true (a tool episode's turns and its "
            "environment are not resumable across an interrupted generation yet; trainer.partial_rollout=false "
            "serves tool episodes: each finishes under the adapter it started with)")]
    for bad, what in why:
        if bad:
            raise ValueError(f"trainer.max_staleness={t.max_staleness}: not with {what}")


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
    if isinstance(r.routes_inline_bytes, bool) or r.routes_inline_bytes < 0:
        raise ValueError(f"rollout.routes_inline_bytes={r.routes_inline_bytes!r}: bytes >= 0 (0: every sample's "
                         "routes by ObjectRef)")
    check_timeout(c.ray.wait_timeout_s, "ray.wait_timeout_s")
    mod, _, name = c.rollout.engine.rpartition(".")
    engine = getattr(importlib.import_module(mod), name)
    check = getattr(engine, "check_kwargs", None)
    if check is not None:
        check(dict(c.rollout.engine_kwargs))
    check_targets = getattr(engine, "check_lora_targets", None)
    if check_targets is not None:  # e.g. vLLM's LoRA mode: max_lora_rank, expert parallelism, MoE kernels
        check_targets(dict(c.rollout.engine_kwargs), c.lora)


def preflight(c, tokenizer, prompt_sets: dict) -> tuple[int, ...]:
    """The checks that need the tokenizer and model config (see the module doc); ``prompt_sets``:
    {"data.train": prompts, "data.val": prompts}. Returns the rollout's stop ids."""
    from glm5_mcore.training.model_source import resolve_model
    from rl.train.mtp import mtp_layers

    m, r = c.model, c.rollout
    glm5 = resolve_model(m).glm5  # as each trainer rank will (a Megatron-LM / Bridge config checked)
    t = c.trainer
    try:
        t.parallel().validate(glm5)
    except ValueError as e:
        raise ValueError(f"trainer.{e} ({m.ckpt or m.hf_dir})") from None
    mtp_layers(c.actor.mtp_loss_scale, glm5, m.ckpt or m.hf_dir, c.actor.mtp_accept)
    vocab = glm5.vocab_size
    stops = r.stop_token_ids if r.stop_token_ids is not None else [tokenizer.eos_token_id]
    stop_ids = token_ids(tokenizer, stops, "rollout.stop_token_ids", vocab)
    if r.multi_turn.enable:
        token_ids(tokenizer, r.multi_turn.tool_call_stop_tokens, "rollout.multi_turn.tool_call_stop_tokens", vocab)
        for line in tool_lines(r.multi_turn):  # the code tool's isolation, in the run's log
            print(line, flush=True)
    ctx = glm5.max_position_embeddings
    a = c.actor
    budgets = [("actor.micro_batch_tokens", a.micro_batch_tokens)]
    if a.log_prob_micro_batch_tokens is not None:
        budgets.append(("actor.log_prob_micro_batch_tokens", a.log_prob_micro_batch_tokens))
    for key, prompts in prompt_sets.items():
        if not prompts:
            continue
        p = max(prompts, key=lambda q: len(q.ids))
        if len(p.ids) + r.max_new_tokens > ctx:
            raise ValueError(f"{key}: {p.where or f'prompt {p.index}'} has {len(p.ids)} tokens; + rollout."
                             f"max_new_tokens={r.max_new_tokens} exceeds the model's context "
                             f"(max_position_embeddings={ctx}); lower data.max_prompt_tokens or rollout.max_new_tokens")
        longest = len(p.ids) + r.max_new_tokens
        # the trainer pads each sample for the CP split (mcore_settings.token_multiple: SP at TP > 1, TE's FP8)
        unit = cp_unit(t.cp, token_multiple_of(t.tp, t.tp > 1, m.base_dtype == "fp8" and t.backend == "te"))
        padded = -(-longest // unit) * unit
        pad = f", padded to {padded} for the trainer.cp={t.cp} split" if padded != longest else ""
        for field, budget in budgets:
            # trained samples only (held-out prompts are generated, never packed); episodes: per sample, by the trainer
            if key == "data.train" and not r.multi_turn.enable and padded > budget:
                raise ValueError(f"{field}={budget}: {key}: {p.where or f'prompt {p.index}'} has {len(p.ids)} "
                                 f"tokens; + rollout.max_new_tokens={r.max_new_tokens} = {longest}{pad} would not "
                                 f"fit one micro-batch (a sample is never split): raise {field} or lower "
                                 "rollout.max_new_tokens")
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


def _check_importable(path: str, field_name: str):
    """``module.Class`` exists (found before Ray starts, not under actor-restart tracebacks); returns it."""
    mod, _, name = str(path).rpartition(".")
    try:
        spec = importlib.util.find_spec(mod) if mod else None
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ValueError(f"{field_name}={path!r}: no module {mod!r} (expected a dotted path module.Class)")
    try:
        return getattr(importlib.import_module(mod), name)
    except AttributeError:
        raise ValueError(f"{field_name}={path!r}: module {mod!r} has no {name!r}") from None
    except ImportError as e:
        raise ValueError(f"{field_name}={path!r}: cannot import ({e})") from None


def validate(c) -> None:
    """Impossible settings of an ``rl.config.RLConfig`` raise a ValueError naming the field (run by
    ``RLConfig.from_dict``)."""
    if not c.model.hf_dir:
        raise ValueError("model.hf_dir: the HF folder (config + tokenizer) must be given")
    if not c.data.train:
        raise ValueError("data.train: the prompt set must be given (a JSONL of prompts, or toy)")
    if c.model.mtp != "auto":
        raise ValueError(f"model.mtp={c.model.mtp!r}: RL builds the MTP block for actor.mtp_loss_scale > 0 or "
                         "actor.mtp_accept (model.mtp is the SFT recipe's)")
    for key, lo in (("lora", c.lora), ("critic.lora", c.critic.lora)):
        if not lo.enabled:
            raise ValueError(f"{key}.enabled=false: the RL trainer trains LoRA adapters on a frozen base")
        if lo.dropout:
            raise ValueError(f"{key}.dropout={lo.dropout}: RL needs deterministic log-probs (0)")
    if c.lora.name != "default":
        raise ValueError(f"lora.name={c.lora.name!r}: the RL policy adapter is 'default' (critic: 'critic')")
    a, r, act = c.algorithm, c.rollout, c.actor
    if a.adv_estimator not in ADV_ESTIMATORS:
        raise ValueError(f"algorithm.adv_estimator={a.adv_estimator!r}: one of {ADV_ESTIMATORS}")
    for key, v in (("algorithm.kl_penalty", a.kl_penalty), ("actor.kl_loss_type", act.kl_loss_type)):
        if v.rstrip("+") not in KL_TYPES:
            raise ValueError(f"{key}={v!r}: one of {KL_TYPES}")
    if act.loss_agg_mode not in AGG_MODES:
        raise ValueError(f"actor.loss_agg_mode={act.loss_agg_mode!r}: one of {AGG_MODES}")
    if r.n < 1 or (a.adv_estimator in ("grpo", "rloo") and r.n < 2):
        raise ValueError(f"rollout.n={r.n}: {a.adv_estimator} needs at least 2 samples per prompt")
    if r.temperature <= 0:
        raise ValueError(f"rollout.temperature={r.temperature} must be > 0 (log-probs are of softmax(logits/T))")
    if not 0 < r.top_p <= 1:
        raise ValueError(f"rollout.top_p={r.top_p} must be in (0, 1]")
    if r.num_actors < 1 or r.max_new_tokens < 1:
        raise ValueError("rollout.num_actors and rollout.max_new_tokens must be >= 1")
    if c.data.prompts_per_step % act.ppo_mini_batch_size:
        raise ValueError(f"actor.ppo_mini_batch_size={act.ppo_mini_batch_size} must divide "
                         f"data.prompts_per_step={c.data.prompts_per_step}")
    for key, v in (("actor.micro_batch_tokens", act.micro_batch_tokens),
                   ("actor.log_prob_micro_batch_tokens", act.log_prob_micro_batch_tokens)):
        if v is not None and v < 1:
            raise ValueError(f"{key}={v} must be >= 1 (tokens per micro-batch)")
    if act.mtp_loss_scale < 0:
        raise ValueError(f"actor.mtp_loss_scale={act.mtp_loss_scale} must be >= 0")
    if act.clip_ratio_c <= 1:
        raise ValueError(f"actor.clip_ratio_c={act.clip_ratio_c} must be > 1 (dual-clip bound)")
    t = c.trainer
    if t.world_size < 1 or t.world_size % t.tp:
        raise ValueError(f"trainer.tp={t.tp} must divide trainer.world_size={t.world_size}")
    if t.world_size % t.ep:
        raise ValueError(f"trainer.ep={t.ep} must divide trainer.world_size={t.world_size}")
    if t.etp < 1 or t.world_size % (t.etp * t.ep):
        raise ValueError(f"trainer.etp={t.etp}: etp × ep = {t.etp * t.ep} must divide trainer.world_size="
                         f"{t.world_size}")
    if t.recompute not in (None, "selective", "full"):
        raise ValueError(f"trainer.recompute={t.recompute!r}: null, selective or full")
    if t.cp < 1 or t.world_size % (t.tp * t.cp):
        raise ValueError(f"trainer.cp={t.cp} must be >= 1 with trainer.tp × trainer.cp = {t.tp * max(t.cp, 1)} "
                         f"dividing trainer.world_size={t.world_size}")
    if t.cp > 1 and (act.mtp_loss_scale > 0 or act.mtp_accept):
        raise ValueError(f"trainer.cp={t.cp}: the MTP loss and rollout/mtp_accept are not context-parallel yet "
                         "(set actor.mtp_loss_scale=0 and actor.mtp_accept=false)")
    corr = a.rollout_correction
    level = corr.rollout_is
    if level not in (None, "token", "sequence"):
        raise ValueError(f"algorithm.rollout_correction.rollout_is={level!r}: token, sequence or null")
    if level is not None:
        from verl.trainer.ppo.rollout_corr_helper import _parse_rollout_is_threshold

        try:
            _parse_rollout_is_threshold(corr.rollout_is_threshold)
        except (TypeError, ValueError) as e:
            raise ValueError(f"algorithm.rollout_correction.rollout_is_threshold: {e}") from None
    if corr.rollout_rs is not None:
        from verl.trainer.ppo.rollout_corr_helper import _parse_rollout_rs_thresholds

        try:
            _parse_rollout_rs_thresholds([o.strip() for o in str(corr.rollout_rs).split(",") if o.strip()],
                                         corr.rollout_rs_threshold)
        except (TypeError, ValueError) as e:
            raise ValueError(f"algorithm.rollout_correction.rollout_rs_threshold: {e}") from None
    if t.steps < 1:
        raise ValueError("trainer.steps must be >= 1")
    if t.off_policy_steps not in (0, 1):
        raise ValueError(f"trainer.off_policy_steps={t.off_policy_steps}: 0 (synchronous) or 1 (one step off-policy)")
    check_async(c)
    check_reward(c.reward)  # finite timeout and scores, max_error_fraction (rl.tasks.checks)
    resolve(fn_path(c.reward.fn), "reward.fn")
    engine = _check_importable(r.engine, "rollout.engine")
    if t.max_staleness and t.partial_rollout and not getattr(engine, "INTERRUPTIBLE", False):
        # a push's interrupt would be a no-op: responses would finish under the adapter they started with
        raise ValueError(f"trainer.partial_rollout=true: rollout.engine={r.engine} cannot interrupt a generation "
                         "(its INTERRUPTIBLE is False); set trainer.partial_rollout=false or use an engine that can")
    mt = r.multi_turn
    if mt.enable:
        check_multi_turn(mt)  # the env, its env_kwargs and (the code tool) this machine's isolation
        if not mt.tool_call_stop_tokens:
            raise ValueError("rollout.multi_turn.tool_call_stop_tokens: needs at least one token when enabled")
        if mt.max_assistant_turns < 1 or mt.max_tool_response_length < 1:
            raise ValueError("rollout.multi_turn.max_assistant_turns and max_tool_response_length must be >= 1")
    if a.router_replay and r.engine.endswith("VLLMRolloutEngine") and not r.engine_kwargs.get("return_routes"):
        raise ValueError("algorithm.router_replay=true with the vLLM engine needs rollout.engine_kwargs.return_routes="
                         "true (vLLM's enable_return_routed_experts)")
    if c.ray.placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
        raise ValueError(f"ray.placement_strategy={c.ray.placement_strategy!r}: PACK, SPREAD, STRICT_PACK or "
                         "STRICT_SPREAD")
    co = r.colocate
    if co.enable:
        if t.off_policy_steps:
            raise ValueError("rollout.colocate.enable=true with trainer.off_policy_steps=1: colocated engines and "
                             "trainer share the GPUs, so they cannot overlap (set trainer.off_policy_steps=0)")
        if t.world_size % r.num_actors:
            raise ValueError(f"rollout.colocate.enable=true: rollout.num_actors={r.num_actors} must divide "
                             f"trainer.world_size={t.world_size} (each engine spans world_size / num_actors bundles)")
        if not 0 < co.engine_fraction < 1:
            raise ValueError(f"rollout.colocate.engine_fraction={co.engine_fraction}: must be in (0, 1)")
        if co.sleep_level not in (None, 1, 2):
            raise ValueError(f"rollout.colocate.sleep_level={co.sleep_level!r}: 1, 2 or null (by push kind)")
        if co.sleep_level == 2 and r.engine.endswith("VLLMRolloutEngine") and not r.engine_kwargs.get("merge"):
            raise ValueError("rollout.colocate.sleep_level=2 with vLLM's LoRA mode: after a level-2 sleep every weight "
                             "is reloaded in place, and vLLM 0.32 cannot reload a module its LoRA layers wrap "
                             "(deepseek_v2.py:1820 finds no '...weight' under '...base_layer'); use sleep_level 1")
        if r.gpus_per_actor:
            raise ValueError("rollout.gpus_per_actor: colocated engines take rollout.colocate.engine_fraction of "
                             "the trainer's bundles instead (set it to 0)")
    check_engine_layout(c)  # vLLM's layouts: no offline DP, an engine over its colocated bundles
    if not t.freeze_indexer:
        raise ValueError("trainer.freeze_indexer=false: the RL trainer keeps the DSA indexer frozen (no indexer "
                         "loss reaches it here, so it would not learn); train it in the SFT sparse stage "
                         "(glm5 sft train.freeze_indexer=false)")
    check_config(c)  # policy loss, R3 + tool episodes, DAPO shaping, engine_kwargs, Ray waits
    if t.backend not in ("local", "te"):
        raise ValueError(f"trainer.backend={t.backend!r}: local or te")
    import torch

    gpu_flags = [f for f, on in (("trainer.backend=te", t.backend == "te"), ("trainer.bf16", t.bf16)) if on]
    if gpu_flags and not t.gpus_per_rank:
        raise ValueError(f"{gpu_flags[0]}: needs a GPU per trainer rank, and trainer.gpus_per_rank=0 gives the "
                         "trainer actors none (set trainer.gpus_per_rank=1)")
    if gpu_flags and not torch.cuda.is_available():
        raise ValueError(f"{gpu_flags[0]}: needs CUDA (Transformer Engine / Megatron's bf16 optimizer); CPU runs are "
                         "fp32 with local modules")
    check_optimizer(OptimCfg(overlap_param_gather=c.actor.overlap_param_gather), t.world_size // (t.tp * t.cp),
                    "actor")
    if c.model.hf_dir and (c.rollout.hf_dir or (Path(c.model.hf_dir) / "config.json").is_file()):
        serving_dir(c.model.hf_dir, c.model.ckpt, c.rollout.hf_dir)  # no model.hf_dir: the driver names it

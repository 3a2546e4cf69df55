"""Multi-turn tool episodes over any engine's token-in / token-out ``generate`` (``rollout.multi_turn``).

An episode is prompt → assistant turn → [tool call → observation → assistant turn]* : each turn is one
``engine.generate`` call on the exact token ids so far (prompt + every earlier turn's sampled ids +
every observation's ids — never re-tokenised text), with the tool-call stop tokens added to the stop
set. A turn that ends in a tool-call stop token goes to the environment (a dotted-path function, like
rewards); its observation text is rendered with the chat template's observation role and appended as
ids, then generation continues, up to ``max_assistant_turns``. The ``Result`` holds the whole episode
after the prompt: ``response_ids``, ``logprobs`` (0 on observation tokens) and ``mask`` (1 = sampled by
the policy, 0 = observation), so the trainer scores exactly the ids the engine produced and consumed,
and observation tokens carry no loss, no IcePop weight and no KL (``batch.response_mask``).

Randomness: turn t of a request samples with ``sample_seed(request.seed, t, 0, 0)`` (turn 0 uses the
request's own seed), so a redone episode is the same episode.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable

from rl.rollout.base import Request, Result, SamplingParams, sample_seed
from rl.validate import token_ids


def load_env(path: str) -> Callable:
    mod, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ValueError(f"rollout.multi_turn.env={path!r}: cannot import ({e})") from None


def tool_token_ids(tokenizer, tokens: list) -> set[int]:
    """``rollout.multi_turn.tool_call_stop_tokens`` (ids or token strings) as ids (checked before Ray starts
    too: ``rl.validate.preflight``)."""
    return set(token_ids(tokenizer, tokens, "rollout.multi_turn.tool_call_stop_tokens", len(tokenizer)))


def observation_ids(tokenizer, text: str, role: str, prev_id: int) -> list[int]:
    """The ids of an observation message with the chat template's ``role`` header and the assistant
    generation prompt after it: rendered after a dummy user turn and cut at that turn's end. When the
    turn's last sampled id ``prev_id`` is the role header itself (GLM's ``<|observation|>`` is both the
    tool-call stop token and the observation role), it is not repeated."""
    def render(msgs, gen):
        out = tokenizer.apply_chat_template(msgs, tokenize=True, add_generation_prompt=gen)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    user = [{"role": "user", "content": "x"}]
    base = render(user, False)
    full = render(user + [{"role": role, "content": text}], True)
    if full[: len(base)] != base:
        raise ValueError(f"chat template: the {role!r} message does not extend the conversation's ids")
    ids = full[len(base):]
    if ids and ids[0] == prev_id:
        ids = ids[1:]
    return ids


def run_episodes(engine, tokenizer, env: Callable, requests: list[Request], params: SamplingParams, mt,
                 batched: bool = True) -> list[Result]:
    """Every request as an episode (see the module docstring); results in request order."""
    tool = tool_token_ids(tokenizer, mt.tool_call_stop_tokens)
    turn_params = dataclasses.replace(params, stop_token_ids=tuple(params.stop_token_ids) + tuple(sorted(tool)))
    ep = {r.key: {"ids": [], "lps": [], "mask": [], "reason": "length"} for r in requests}
    live = list(requests)
    for turn in range(mt.max_assistant_turns):
        reqs = [Request(r.key, list(r.prompt_ids) + ep[r.key]["ids"],
                        r.seed if turn == 0 else sample_seed(r.seed, turn, 0, 0)) for r in live]
        outs = engine.generate(reqs, turn_params, batched)
        nxt = []
        for r, out in zip(live, outs):
            e = ep[r.key]
            e["ids"] += out.response_ids
            e["lps"] += out.logprobs
            e["mask"] += [1] * len(out.response_ids)
            e["reason"] = out.finish_reason
            called = out.finish_reason == "stop" and out.response_ids and out.response_ids[-1] in tool
            if not called or turn == mt.max_assistant_turns - 1:
                continue
            obs = env(tokenizer.decode(r.prompt_ids), tokenizer.decode(e["ids"]))
            if obs is None:
                continue
            ids = observation_ids(tokenizer, str(obs), mt.observation_role, e["ids"][-1])
            head = ids[: mt.max_tool_response_length]
            e["ids"] += head
            e["lps"] += [0.0] * len(head)
            e["mask"] += [0] * len(head)
            nxt.append(r)
        live = nxt
        if not live:
            break
    return [Result(r.key, ep[r.key]["ids"], ep[r.key]["lps"], ep[r.key]["reason"], mask=ep[r.key]["mask"])
            for r in requests]


def apply_masks(batch, results: list[Result]) -> None:
    """Zero ``batch.response_mask`` on observation tokens (rows with a ``mask``)."""
    import torch

    for i, r in enumerate(results):
        if r.mask is not None:
            batch.response_mask[i, : len(r.mask)] *= torch.tensor(r.mask, dtype=batch.response_mask.dtype)

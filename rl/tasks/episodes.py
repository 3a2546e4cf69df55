"""Multi-turn tool episodes over any engine's token-in / token-out ``generate`` (``rollout.multi_turn``).

An episode is prompt → assistant turn → [tool call → observation → assistant turn]* : each turn is one
``engine.generate`` call on the exact token ids so far (prompt + every earlier turn's sampled ids +
every observation's ids — never re-tokenised text), with the tool-call stop tokens added to the stop
set. A turn that ends in a tool-call stop token goes to the environment (a dotted-path function, like
rewards); its observation text is rendered with the chat template's observation role and appended as
ids, then generation continues, up to ``max_assistant_turns``. The observation's text stays text: only the
template's own header and closing carry control tokens, a control token's string inside the text (a tool that
prints ``<|assistant|>`` or ``<|endoftext|>``) is tokenized as plain characters (``text_ids``), never as a turn
boundary or an EOS the policy did not emit. The ``Result`` holds the whole episode
after the prompt: ``response_ids``, ``logprobs`` (0 on observation tokens) and ``mask`` (1 = sampled by
the policy, 0 = observation), so the trainer scores exactly the ids the engine produced and consumed,
and observation tokens carry no loss, no IcePop weight and no KL (``batch.response_mask``).

The environment runs in ``tool_workers`` worker processes (``rl.tasks.proc_pool``) with a wall timeout per call
(``tool_timeout_s``): a call that hangs, raises or crashes becomes an observation that says so and names
the env, never an exception in the rollout actor. An observation is cut to ``max_tool_response_length``
tokens inside its message (the role header and the assistant generation prompt after it are kept), and
to what the context leaves: prompt + episode + observation + the next turn's ``max_new_tokens`` stay
within the engine's ``max_positions``; when not even the empty message fits, the episode ends there.
``Result.tool_stats`` counts calls, errors, timeouts, cut and dropped observations (``tool/*`` metrics).

Randomness: turn t of a request samples with ``sample_seed(request.seed, t, 0, 0)`` (turn 0 uses the
request's own seed), so a redone episode is the same episode.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

from rl.tasks.proc_pool import Outcome, ProcessPool, resolve
from rl.rollout.base import Request, Result, SamplingParams, sample_seed
from rl.tasks.prompts import token_ids

FIELD = "rollout.multi_turn.env"
TOOL_STATS = ("calls", "errors", "timeouts", "cut", "dropped")


def load_env(path: str) -> Callable:
    return resolve(path, FIELD)


class ToolRunner:
    """``rollout.multi_turn.env`` over a batch of calls: in ``tool_workers`` processes with
    ``tool_timeout_s`` per call, or in this process (``tool_workers=0``, or a plain function: no timeout,
    but a raise is still an observation). ``__call__`` returns (observation text or None, status)."""

    def __init__(self, name: str, pool: Optional[ProcessPool] = None, fn: Optional[Callable] = None,
                 kwargs: Optional[dict] = None):
        self.name, self.pool, self.fn, self.kwargs = name, pool, fn, dict(kwargs or {})

    @classmethod
    def from_config(cls, mt) -> "ToolRunner":
        if mt.tool_workers:
            return cls(mt.env, ProcessPool(mt.env, mt.tool_workers, mt.tool_timeout_s, mt.env_kwargs, FIELD))
        return cls(mt.env, fn=load_env(mt.env), kwargs=mt.env_kwargs)

    def __call__(self, calls: list[tuple[str, str]]) -> list[tuple[Optional[str], str]]:
        if self.pool is not None:
            outs = self.pool.map(calls)
        else:
            outs = []
            for args in calls:
                try:
                    outs.append(Outcome("ok", self.fn(*args, **self.kwargs)))
                except Exception as e:  # the env's failure is this call's observation
                    outs.append(Outcome("error", message=f"{type(e).__name__}: {e}"))
        res = []
        for o in outs:
            if o.ok:
                res.append((None if o.value is None else str(o.value), "ok"))
            elif o.status == "timeout":
                res.append((f"error: the tool ({FIELD}={self.name}) did not return within "
                            f"{self.pool.timeout_s:g} s; the call was stopped", "timeouts"))
            else:
                what = "raised" if o.status == "error" else "crashed:"
                res.append((f"error: the tool ({FIELD}={self.name}) {what} {o.message}", "errors"))
        return res

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def tool_token_ids(tokenizer, tokens: list) -> set[int]:
    """``rollout.multi_turn.tool_call_stop_tokens`` (ids or token strings) as ids (checked before Ray starts
    too: ``rl.validate.preflight``)."""
    return set(token_ids(tokenizer, tokens, "rollout.multi_turn.tool_call_stop_tokens", len(tokenizer)))


CONTENT_MARK = "GLM5OBSERVATIONCONTENT"
"""What the observation message is rendered with to find where the template puts its content."""
ESCAPE = "\u200b"
"""Put after a control token's first character in observation text whose plain-text tokenization still gives
that token (a vocabulary holding the token's string as an ordinary word): a zero-width space."""


def control_ids(tokenizer) -> set[int]:
    """The ids an environment's text must never become: every special added token (turn headers, EOS, BOS,
    pad, ``[gMASK]``, ...) but the unknown token, which is what text a vocabulary cannot spell becomes."""
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids = {int(i) for i, t in decoder.items() if getattr(t, "special", False)} | set(tokenizer.all_special_ids)
    return ids - {tokenizer.unk_token_id}


def text_ids(tokenizer, text: str) -> list[int]:
    """The ids of untrusted ``text`` (a tool's output, an environment's message), a control token's string in it
    taken as plain text (``split_special_tokens``): a tool that prints ``<|assistant|>`` or ``<|endoftext|>``
    gives the policy those characters, never a turn boundary or an EOS it did not emit. Where the vocabulary
    itself spells such a string as that token (a word-level vocabulary), the string is escaped (``ESCAPE``)
    first; a tokenizer that still gives a control id is a ValueError."""
    control = control_ids(tokenizer)
    ids = list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
    if not control.intersection(ids):
        return ids
    for tok in sorted(tokenizer.convert_ids_to_tokens(sorted(control)), key=len, reverse=True):
        if tok and len(tok) > 1:
            text = text.replace(tok, tok[0] + ESCAPE + tok[1:])
    ids = list(tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
    bad = sorted(control.intersection(ids))
    if bad:
        raise ValueError(f"observation text: the tokenizer turns it into control token(s) "
                         f"{tokenizer.convert_ids_to_tokens(bad)} even escaped")
    return ids


def observation_parts(tokenizer, text: str, role: str, prev_id: int) -> tuple[list[int], list[int], list[int]]:
    """(header ids, content ids, closing ids) of an observation message: the chat template's ``role`` message
    after a dummy user turn, with the assistant generation prompt after it. The template's own text (the role
    header, its closing, the generation prompt) is tokenized with its control tokens; the content, as the
    template renders ``text``, by ``text_ids``, so nothing in it becomes a control token. When the turn's last
    sampled id ``prev_id`` is the role header itself (GLM's ``<|observation|>`` is both the tool-call stop token
    and the observation role), it is not repeated."""
    def render(msgs, gen) -> str:
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    def ids(s: str) -> list[int]:
        return list(tokenizer.encode(s, add_special_tokens=False))

    user = [{"role": "user", "content": "x"}]
    base = render(user, False)
    head, found, tail = render(user + [{"role": role, "content": CONTENT_MARK}], True).partition(CONTENT_MARK)
    full = render(user + [{"role": role, "content": text}], True) if text else head + tail  # empty: the shell
    if not found or CONTENT_MARK in tail or not head.startswith(base) or not full.startswith(head) or \
            not full.endswith(tail) or len(full) < len(head) + len(tail):
        raise ValueError(f"chat template: the {role!r} message's content is not rendered between a fixed header "
                         "and closing")
    base_ids, head_ids = ids(base), ids(head)
    if head_ids[: len(base_ids)] != base_ids:
        raise ValueError(f"chat template: the {role!r} message does not extend the conversation's ids")
    header = head_ids[len(base_ids):]
    if header and header[0] == prev_id:
        header = header[1:]
    return header, text_ids(tokenizer, full[len(head): len(full) - len(tail)]), ids(tail)


def observation_ids(tokenizer, text: str, role: str, prev_id: int) -> list[int]:
    """The ids of an observation message (``observation_parts``, joined)."""
    header, content, closing = observation_parts(tokenizer, text, role, prev_id)
    return header + content + closing


def fit_observation(tokenizer, text: str, role: str, prev_id: int, budget: int) -> tuple[Optional[list[int]], bool]:
    """(ids, cut): ``observation_ids`` within ``budget`` tokens, cutting the content and keeping the
    message's header and the generation prompt after it; (None, True) when not even the empty message
    fits."""
    header, content, closing = observation_parts(tokenizer, text, role, prev_id)
    room = budget - len(header) - len(closing)
    if room < 0:
        return None, True
    return header + content[:room] + closing, len(content) > room


def run_episodes(engine, tokenizer, env: Callable | ToolRunner, requests: list[Request], params: SamplingParams,
                 mt, batched: bool = True) -> list[Result]:
    """Every request as an episode (see the module docstring); results in request order. ``env``: a
    ``ToolRunner`` or a plain function (called in this process)."""
    runner = env if isinstance(env, ToolRunner) else ToolRunner(getattr(env, "__qualname__", str(env)), fn=env)
    tool = tool_token_ids(tokenizer, mt.tool_call_stop_tokens)
    turn_params = dataclasses.replace(params, stop_token_ids=tuple(params.stop_token_ids) + tuple(sorted(tool)))
    context = getattr(engine, "max_positions", None)
    ep = {r.key: {"ids": [], "lps": [], "mask": [], "reason": "length", "stats": dict.fromkeys(TOOL_STATS, 0)}
          for r in requests}
    live = list(requests)
    for turn in range(mt.max_assistant_turns):
        reqs = [Request(r.key, list(r.prompt_ids) + ep[r.key]["ids"],
                        r.seed if turn == 0 else sample_seed(r.seed, turn, 0, 0)) for r in live]
        outs = engine.generate(reqs, turn_params, batched)
        calling = []
        for r, out in zip(live, outs):
            e = ep[r.key]
            e["ids"] += out.response_ids
            e["lps"] += out.logprobs
            e["mask"] += [1] * len(out.response_ids)
            e["reason"] = out.finish_reason
            called = out.finish_reason == "stop" and out.response_ids and out.response_ids[-1] in tool
            if called and turn < mt.max_assistant_turns - 1:
                calling.append(r)
        obs = runner([(tokenizer.decode(r.prompt_ids), tokenizer.decode(ep[r.key]["ids"])) for r in calling])
        nxt = []
        for r, (text, status) in zip(calling, obs):
            e = ep[r.key]
            e["stats"]["calls"] += 1
            if status != "ok":
                e["stats"][status] += 1
            if text is None:
                continue
            budget = mt.max_tool_response_length
            if context is not None:  # room for the observation and the next turn
                budget = min(budget, context - len(r.prompt_ids) - len(e["ids"]) - params.max_new_tokens)
            ids, cut = fit_observation(tokenizer, text, mt.observation_role, e["ids"][-1], budget)
            e["stats"]["cut"] += int(cut and ids is not None)
            if ids is None:  # the context is full: the episode ends at this call
                e["stats"]["dropped"] += 1
                continue
            e["ids"] += ids
            e["lps"] += [0.0] * len(ids)
            e["mask"] += [0] * len(ids)
            nxt.append(r)
        live = nxt
        if not live:
            break
    return [Result(r.key, ep[r.key]["ids"], ep[r.key]["lps"], ep[r.key]["reason"], mask=ep[r.key]["mask"],
                   tool_stats=ep[r.key]["stats"]) for r in requests]


def tool_metrics(results: list[Result]) -> dict:
    """``tool/calls``, ``tool/errors``, ``tool/timeouts``, ``tool/cut``, ``tool/dropped`` summed over the
    batch's episodes (empty when none ran)."""
    stats = [r.tool_stats for r in results if getattr(r, "tool_stats", None)]
    return {f"tool/{k}": float(sum(s[k] for s in stats)) for k in TOOL_STATS} if stats else {}

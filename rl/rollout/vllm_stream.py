"""A request on vLLM (``VLLMRolloutEngine``): its sampling keywords and seed (``vllm_sampling``,
``request_seed``), its ``Result`` (``to_result``) — and continuous generation (``VLLMRolloutEngine.stream_*``):
vLLM's own scheduler already runs a
stream — requests join and leave its running batch at every engine step — so the stream is that loop kept
alive across calls instead of one ``generate`` per batch.

- ``ServerStream`` (in the vLLM server process, ``vllm_server.Server.stream_step``): requests are added to
  the ``LLMEngine`` as they come (``add_request``, DELTA outputs) and ``step`` runs ``LLMEngine.step`` until
  at least one request finishes, ``timeout_s`` passes or the engine interrupts the call; each finished
  request comes back at once, its slot taken by the next waiting one (vLLM's scheduler: ``max_num_seqs``).
  ``abort`` hands back every live request with what it sampled (``"interrupted"``).
- ``EngineStream`` (the engine's side, in the rollout actor): submitted requests wait in a local queue
  (``stream_submit`` runs in the actor's control group, beside a running poll: the server's socket takes one
  call at a time) and go to the server with the next poll. An ``interrupt`` is sticky while the stream holds
  work: the next poll aborts every live request and hands back the queued ones unstarted. An adapter pushed
  while requests are live waits for them (``hold``: nothing new is added meanwhile), so a response never spans
  two adapters without an interruption (a push reloads weights in place, under the live requests' KV cache).

A continued request (``prefix_ids``) is served as ``generate`` serves it: prompt + prefix, the rest of the
budget, seeded ``request_seed(seed, len(prefix))``.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Optional

import numpy as np

from rl.rollout.base import Result, token_seed


def request_seed(seed: int, start: int) -> int:
    """vLLM's seed for a request that starts at response token ``start`` of a sample seeded ``seed``: ``seed``
    for a new response, ``token_seed(seed, start)`` for a continued one (partial rollouts), both mod 2^31.

    vLLM samples every token of a request from one generator seeded once (its state after t draws is not
    something a new request can start from), so ``SamplingParams.seed_per_token`` is served per (sample
    seed, start position): the same seeds interrupted at the same tokens give the same run, token for
    token; an interrupted and continued response is a different sample from the same per-token distributions
    as the uninterrupted one, not the same tokens (greedy decoding: the same tokens)."""
    return (seed if start == 0 else token_seed(seed, start)) % (2 ** 31)


def vllm_sampling(requests: list, params, spec_on_cpu: bool = False) -> list[dict]:
    """Each request's ``vllm.SamplingParams`` keywords: the rest of the token budget past its prefix, seeded
    ``request_seed(seed, len(prefix))``, stopping exactly at ``params.stop_token_ids``, the sampled token's
    processed log-prob; refusing what IcePop cannot be given (``spec_on_cpu``: vLLM-CPU drafting)."""
    if params.top_p < 1.0:
        raise ValueError("VLLMRolloutEngine: rollout.top_p < 1 makes vLLM's log-probs nucleus-renormalised; "
                         "IcePop needs log_softmax(logits / T) over the full vocabulary")
    if spec_on_cpu and params.temperature > 0:
        raise ValueError("VLLMRolloutEngine: vLLM-CPU 0.32's speculative sampling returns wrong processed "
                         "log-probs at temperature > 0 (uniform or NaN after the first token; greedy ones "
                         "are right); IcePop needs the true ones: sample greedily or without mtp_draft_tokens")
    for r in requests:
        r.check_prefix(params.max_new_tokens)
    return [dict(temperature=params.temperature, top_p=1.0, max_tokens=params.max_new_tokens - len(r.prefix_ids),
                 stop_token_ids=list(params.stop_token_ids), ignore_eos=True,
                 seed=request_seed(r.seed, len(r.prefix_ids)), logprobs=0, detokenize=False)
            for r in requests]


def add_requests(llm, rids: list[str], prompts: list[list[int]], params: list[dict], lora: Optional[tuple]) -> None:
    """``prompts`` (token ids) into ``llm``'s engine as requests ``rids`` with ``vllm.SamplingParams(**p)``,
    DELTA outputs (what each step sampled), ``lora`` = (name, int id, routed experts in 3D) of an adapter
    the workers hold (``rl.rollout.vllm_adapters``) or None."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.renderers.inputs.preprocess import parse_model_prompt
    from vllm.sampling_params import RequestOutputKind

    request = None
    if lora is not None:
        from rl.rollout.vllm_adapters import lora_request

        request = lora_request(*lora)
    engine, renderer = llm.llm_engine, llm.renderer
    inputs = renderer.render_cmpl([parse_model_prompt(llm.model_config, TokensPrompt(prompt_token_ids=list(p)))
                                   for p in prompts], renderer.default_cmpl_tok_params)
    for rid, engine_input, p in zip(rids, inputs, params):
        sp = SamplingParams(**p)
        sp.output_kind = RequestOutputKind.DELTA
        engine.add_request(rid, engine_input, sp, lora_request=request)


def absorb(acc: dict, outputs) -> list[str]:
    """Append each DELTA output's tokens and log-probs to ``acc[rid] = [ids, lps, reason, routes]``; the
    request ids that finished."""
    done = []
    for o in outputs:
        a = acc[o.request_id]
        c = o.outputs[0]
        new = list(c.token_ids)
        a[0] += new
        a[1] += [float(step[t].logprob) for step, t in zip(c.logprobs, new)]
        if o.finished:
            routes = getattr(c, "routed_experts", None)  # [tokens, moe_layers, top_k] (R3)
            a[2], a[3] = str(c.finish_reason), None if routes is None else np.asarray(routes)
            done.append(o.request_id)
    return done


class ServerStream:
    """The server's live stream requests: rid -> [ids, lps, reason, routes]."""

    def __init__(self, llm):
        self.llm = llm
        self.acc: dict = {}

    def add(self, adds: list) -> None:
        """``adds``: [(rid, prompt ids, sampling params dict, lora or None)]."""
        for rid, prompt, params, lora in adds:
            self.acc[rid] = [[], [], None, None]
            add_requests(self.llm, [rid], [prompt], [params], lora)

    def step(self, timeout_s: float, stop: Callable[[], bool]) -> list:
        """Engine steps until a request finishes, ``timeout_s`` passes or ``stop()``: [(rid, ids, lps, reason,
        routes)] of the finished ones (after ``stop()``: every live one too, aborted, ``"interrupted"``)."""
        engine, out = self.llm.llm_engine, []
        t_end = time.perf_counter() + timeout_s
        while self.acc and not out and time.perf_counter() < t_end and not stop():
            out = [self._pop(rid) for rid in absorb(self.acc, engine.step())]
        return out + (self.abort() if stop() else [])

    def abort(self) -> list:
        """Every live request aborted, with what it sampled, ``"interrupted"``."""
        if self.acc:
            self.llm.llm_engine.abort_request(sorted(self.acc))
        out = [(rid, a[0], a[1], "interrupted", None) for rid, a in self.acc.items()]
        self.acc = {}
        return out

    def _pop(self, rid: str) -> tuple:
        ids, lps, reason, routes = self.acc.pop(rid)
        return rid, ids, lps, reason, routes


class EngineStream:
    """The engine's side: the local queue, the requests the server holds, and each one's adapter version."""

    def __init__(self):
        self.lock = threading.Lock()
        self.waiting: deque = deque()  # (Request, vLLM params dict)
        self.live: dict = {}  # rid -> (Request, version)
        self.stop = False
        """Sticky interrupt: the next poll aborts the live requests and hands back the queued ones."""
        self.hold = False
        """True: add nothing (an adapter waits for the live requests to finish)."""
        self.n = 0

    def has_work(self) -> bool:
        with self.lock:
            return bool(self.waiting) or bool(self.live)

    def submit(self, items: list) -> None:
        with self.lock:
            self.waiting.extend(items)

    def interrupt(self) -> None:
        with self.lock:
            if self.waiting or self.live:
                self.stop = True

    def take_adds(self, lora: Optional[tuple], version: int) -> tuple[list, bool, list]:
        """(adds for ``ServerStream.add``, abort?, the queued requests handed back unstarted on an abort)."""
        with self.lock:
            abort, self.stop = self.stop, False
            if abort:
                queued, self.waiting = [r for r, _ in self.waiting], deque()
                return [], True, queued
            if self.hold:
                return [], False, []
            adds = []
            while self.waiting:
                r, p = self.waiting.popleft()
                self.n += 1
                rid = f"glm5-s{self.n}"
                self.live[rid] = (r, version)
                adds.append((rid, list(r.prompt_ids) + list(r.prefix_ids), p, lora))
            return adds, False, []

    def poll(self, call: Callable, lora: Optional[tuple], version: int, timeout_s: float, route_dtype) -> list:
        """One ``Server.stream_step`` through ``call(adds, timeout_s, abort)``: the requests queued since the last
        poll go in (under ``lora``, booked with ``version``), the finished ones come back as ``Result``s with
        the version each was sampled under; after an interrupt every live and queued one, ``"interrupted"``."""
        adds, abort, queued = self.take_adds(lora, version)
        got = call(adds, timeout_s, abort)
        out = []
        with self.lock:
            for rid, ids, lps, reason, routes in got:
                r, v = self.live.pop(rid)
                out.append(to_result(r, ids, lps, reason, routes, route_dtype, v))
            if not self.waiting and not self.live:
                self.stop = False  # nothing left that an interrupt could have meant
        return out + [to_result(q, [], [], "interrupted", None, route_dtype, version) for q in queued]


def to_result(r, ids: list, lps: list, reason: str, routes, route_dtype, version: Optional[int] = None):
    """A ``Result`` from what vLLM sampled for request ``r``: its prefix then ``ids`` (with ``lps``), routes
    cut to the tokens the engine processed (prompt + all but the last sampled), vLLM's finish reason mapped
    to ours."""
    ids, lps = list(r.prefix_ids) + list(ids), list(r.prefix_logprobs) + list(lps)
    if routes is not None:
        routes = np.ascontiguousarray(routes[: len(r.prompt_ids) + len(ids) - 1]).astype(route_dtype)
    why = reason if reason in ("stop", "interrupted") else "length"
    return Result(r.key, ids, lps, why, routes=routes, version=version)

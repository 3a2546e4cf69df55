"""Continuous decoding for the HF engine (``HFRolloutEngine.stream_*``): a fixed number of slots
(``max_num_seqs``), requests admitted into freed slots at token boundaries, each ``Result`` handed back the
token it finishes — the engine never decodes a finished row, nor waits for a batch's longest response.

**Cohorts.** Requests admitted at one token boundary with equal prompt + prefix length form a cohort: one
prefill forward, one batched KV cache (transformers' ``DynamicCache``, the DSA indexer's key cache with it),
then one decode forward per token for the cohort. A row that finishes leaves at once
(``Cache.reorder_cache`` keeps the others' rows), its slot is free for the next admission. Rows of different
lengths never share a forward, so no padding, attention mask or position offset enters a forward: each row
sees the forward the batch engine (``HFRolloutEngine.generate``) runs for it. Sampling is per row and keyed as
there (``SamplingParams.seed_per_token``: token t's generator is seeded ``token_seed(seed, t)``), so which
rows share a cohort changes no draw. What it can change: CPU GEMM blocking depends on a forward's row count,
so a row's logits agree with the batch engine's to float rounding (~1e-6 on the tiny model), not bitwise —
the batch engine is no different (its batches are whichever requests share a length).

Admission waits until ``admit_fraction`` of the slots are free (or the queue fits): each cohort is a forward
per token, so admitting one request per freed slot would multiply the forwards of a token boundary.

``Occupancy`` is the time-averaged live rows / slots (``rollout/engine_occupancy``), for this path and the
batch one alike (a static batch keeps its finished rows' slots until the batch ends).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from rl.rollout.base import Request, Result, SamplingParams, token_seed


def top_p_probs(logits_BV: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """softmax(logits / T) [B, V] with the tokens outside the top-p nucleus zeroed and the rest renormalised."""
    probs = torch.softmax(logits_BV / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sp, si = probs.sort(dim=-1, descending=True)
    drop = sp.cumsum(-1) - sp > top_p
    sp = sp.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter(-1, si, sp / sp.sum(-1, keepdim=True))


class Occupancy:
    """Live rows x seconds accumulated by the decode loops; ``take()`` is their time average over the wall
    time since the last ``take`` (idle time counts as empty slots), divided by ``slots``."""

    def __init__(self, slots: int):
        self.slots, self.live_s, self.t0 = slots, 0.0, time.perf_counter()

    def add(self, live: int, seconds: float) -> None:
        self.live_s += live * seconds

    def take(self) -> dict:
        now = time.perf_counter()
        wall, self.t0 = max(now - self.t0, 1e-9), now
        live_s, self.live_s = self.live_s, 0.0
        return {"occupancy": live_s / (self.slots * wall), "live_row_s": live_s, "wall_s": wall, "slots": self.slots}


@dataclass
class Row:
    """One admitted request as it decodes."""
    req: Request
    gen: torch.Generator
    budget: int
    """Response tokens it may hold in all (prefix included)."""
    toks: list
    lps: list
    routes: list = field(default_factory=list)
    """Per forward: this row's routes [1, S, moe_layers, top_k] (R3)."""
    index: list = field(default_factory=list)
    """Per forward: this row's [(position, keys [Li, K])] of sampled indexer rows."""
    reason: str = "length"
    done: bool = False


@dataclass
class Cohort:
    rows: list
    cache: object
    logits: torch.Tensor
    """[B, V] float32: the next token's logits of each row."""
    length: int
    """Tokens in the cache (every row's prompt + response so far)."""


class SlotDecoder:
    """The ``slots`` rows of one engine. ``net()`` returns the model to run (PEFT-wrapped or not, as loaded
    now); ``budget(request, params) -> int`` is a request's response-token budget (``params.max_new_tokens``
    unless an engine forces lengths, as the bench's does); ``routes`` / ``index_rows`` are the engine's
    recorders (``rl.rollout.routes``), fed one call per forward."""

    def __init__(self, net: Callable, cache_kw: str, routes, index_rows, device, slots: int,
                 budget: Callable, admit_fraction: float = 0.25):
        self.net, self.cache_kw, self.routes, self.index_rows, self.device = net, cache_kw, routes, index_rows, device
        self.slots, self.budget = slots, budget
        self.admit_min = max(1, int(slots * admit_fraction))
        self.waiting: deque = deque()
        self.cohorts: list[Cohort] = []
        self.params: Optional[SamplingParams] = None
        self.cv = threading.Condition()
        self.hold = False
        """True: admit nothing (an adapter waits for the live rows to finish: no row spans two adapters)."""
        self.prefill_tokens = 0

    @property
    def live(self) -> int:
        return sum(len(c.rows) for c in self.cohorts)

    def has_work(self) -> bool:
        with self.cv:
            return bool(self.waiting) or bool(self.cohorts)

    def submit(self, requests: list[Request], params: SamplingParams) -> None:
        """Queue ``requests`` (every request of a stream with the same ``params``)."""
        with self.cv:
            if self.params is not None and params != self.params and (self.waiting or self.cohorts):
                raise ValueError(f"stream_submit: sampling params {params} differ from the stream's {self.params}")
            self.params = params
            self.waiting.extend(requests)
            self.cv.notify_all()

    def wait_for_work(self, timeout_s: float) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: bool(self.waiting) or bool(self.cohorts), timeout=timeout_s)

    # ------------------------------------------------------------------ one token boundary
    def step(self, occupancy: Occupancy) -> list[Result]:
        """Admit into free slots, sample one token for every live row, retire the finished rows (returned),
        then run one decode forward per cohort for the rest."""
        t0 = time.perf_counter()
        self._admit()
        live = self.live
        done: list[Result] = []
        p = self.params
        for c in self.cohorts:
            logp = torch.log_softmax(c.logits / p.temperature, dim=-1).cpu()
            probs = top_p_probs(c.logits, p.temperature, p.top_p).cpu()
            for i, row in enumerate(c.rows):
                if p.seed_per_token:
                    row.gen.manual_seed(token_seed(row.req.seed, len(row.toks)))
                tok = int(torch.multinomial(probs[i], 1, generator=row.gen))
                row.toks.append(tok)
                row.lps.append(float(logp[i, tok]))
                if tok in p.stop_token_ids:
                    row.done, row.reason = True, "stop"
                elif len(row.toks) >= row.budget:
                    row.done = True
            done += [self.result(r) for r in c.rows if r.done]
            keep = [i for i, r in enumerate(c.rows) if not r.done]
            if len(keep) < len(c.rows) and keep:
                c.cache.reorder_cache(torch.tensor(keep, device=self.device))
            c.rows = [c.rows[i] for i in keep]
        self.cohorts = [c for c in self.cohorts if c.rows]
        occupancy.add(live, time.perf_counter() - t0)
        return done

    def forward(self, occupancy: Occupancy) -> None:
        """One decode forward per cohort (each row's last sampled token)."""
        t0 = time.perf_counter()
        for c in self.cohorts:
            B = len(c.rows)
            nxt = torch.tensor([[r.toks[-1]] for r in c.rows], dtype=torch.long, device=self.device)
            out = self.net()(input_ids=nxt, use_cache=True, **{self.cache_kw: c.cache})
            self._record(c.rows, B, 1, c.length)
            c.cache, c.logits, c.length = out.past_key_values, out.logits[:, -1].float(), c.length + 1
        occupancy.add(self.live, time.perf_counter() - t0)

    def drain(self) -> list[Result]:
        """Every live row and queued request as an ``"interrupted"`` result (the response so far)."""
        with self.cv:
            queued, self.waiting = list(self.waiting), deque()
        out = []
        for c in self.cohorts:
            for r in c.rows:
                r.reason = "interrupted"
                out.append(self.result(r))
        self.cohorts = []
        return out + [Result(q.key, list(q.prefix_ids), list(q.prefix_logprobs), "interrupted") for q in queued]

    # ------------------------------------------------------------------ internals
    def _admit(self) -> None:
        free = self.slots - self.live
        with self.cv:
            if self.hold or not self.waiting or free < min(len(self.waiting), self.admit_min):
                return
            take = [self.waiting.popleft() for _ in range(min(free, len(self.waiting)))]
        groups: dict[int, list[Request]] = {}
        for r in take:
            groups.setdefault(len(r.prompt_ids) + len(r.prefix_ids), []).append(r)
        for n, reqs in groups.items():
            ids = torch.tensor([r.prompt_ids + list(r.prefix_ids) for r in reqs], dtype=torch.long, device=self.device)
            out = self.net()(input_ids=ids, use_cache=True)
            self.prefill_tokens += ids.numel()
            rows = [Row(r, torch.Generator().manual_seed(r.seed), self.budget(r, self.params), list(r.prefix_ids),
                        list(r.prefix_logprobs)) for r in reqs]
            self._record(rows, len(rows), n, 0)
            self.cohorts.append(Cohort(rows, out.past_key_values, out.logits[:, -1].float(), n))

    def _record(self, rows: list[Row], B: int, S: int, start: int) -> None:
        """This forward's routes and indexer rows, split per row."""
        chunk = self.routes.step(B, S)
        index = self.index_rows.step(start, B, S)
        for i, r in enumerate(rows):
            if chunk is not None:
                r.routes.append(chunk[i: i + 1])
            r.index.append(index[i])

    def result(self, r: Row) -> Result:
        seen = len(r.req.prompt_ids) + len(r.toks) - 1  # tokens a forward processed (all but the last sampled)
        routes = None if not r.routes else self.routes.sample_routes(r.routes, 0, seen)
        index = self.index_rows.sample_rows([[sum(r.index, [])]], 0, seen)
        return Result(r.req.key, r.toks, r.lps, r.reason, routes=routes, index_topk=index)

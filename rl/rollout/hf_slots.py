"""Continuous decoding for the HF engine (``HFRolloutEngine.stream_*``): a fixed number of slots
(``max_num_seqs``), requests admitted into freed slots at token boundaries, each ``Result`` handed back the
token it finishes — the engine never decodes a finished row, nor waits for a batch's longest response.

**Cohorts, merged.** Requests admitted at one token boundary are prefilled in forwards of neighbouring
lengths (``prefill_buckets``: the fewest padded tokens a forward's fixed cost is worth), each left-padded to
its longest (no padding where they share a length: each row's prefill is then the batch engine's). Their KV
cache (transformers' ``DynamicCache``, the DSA indexer's key cache with it) then joins the live rows' cache:
the shorter side is left-padded along the sequence, so every live row decodes in **one forward per token**
whatever its length.
A padded row's forward gets a 2-D attention mask (0 on its pad columns: the attention and the indexer both
add it, so a pad key is never attended nor counted among the top-k of a row that has k real keys) and its
own position id (RoPE sees the unpadded position). A row that finishes leaves at once
(``Cache.reorder_cache``), the pad columns every remaining row has are cut, and its slot is free for the next
admission. Without padding (one cohort) the forward is exactly the batch engine's; with it the same math over
masked columns. Sampling is per row and keyed as there (``SamplingParams.seed_per_token``: token t's generator
is seeded ``token_seed(seed, t)``), so which rows share a forward changes no draw. What it can change: CPU
GEMM blocking depends on a forward's shape, so a row's logits agree with the batch engine's to float rounding
(~1e-6 on the tiny model), not bitwise — the batch engine is no different (its batches are whichever
requests share a length). A cache whose layers hold tensors this module does not know is not merged (its
cohorts decode one forward each, as before).

Admission waits until ``admit_fraction`` of the slots are free (or the queue fits): each admission is a
prefill forward (one per distinct length where merging is off).

``Occupancy`` (``rl.rollout.base``) is the time-averaged live rows / slots (``rollout/engine_occupancy``), for
this path and the batch one alike (a static batch keeps its finished rows' slots until the batch ends).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from rl.rollout.base import Occupancy, Request, Result, SamplingParams, token_seed


def top_p_probs(logits_BV: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """softmax(logits / T) [B, V] with the tokens outside the top-p nucleus zeroed and the rest renormalised."""
    probs = torch.softmax(logits_BV / temperature, dim=-1)
    if top_p >= 1.0:
        return probs
    sp, si = probs.sort(dim=-1, descending=True)
    drop = sp.cumsum(-1) - sp > top_p
    sp = sp.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter(-1, si, sp / sp.sum(-1, keepdim=True))


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
    """Columns in the cache (the longest row's prompt + response so far; shorter rows left-padded)."""
    pads: list = None
    """Per row: its left pad columns (0: unpadded)."""

    def __post_init__(self):
        if self.pads is None:
            self.pads = [0] * len(self.rows)


CACHE_SEQ_DIMS = {"keys": -2, "values": -2, "indexer_keys": 1}
"""Per-row tensors of a transformers cache layer (batch first) and their sequence dim: ``DynamicLayer``'s
keys / values [B, H, L, D], ``DynamicIndexedLayer``'s indexer keys [B, L, D]."""


def cache_tensors(cache) -> Optional[list[dict]]:
    """Per layer {name: tensor} of ``cache``'s per-row tensors, or None where a layer holds another tensor
    (a layout this module cannot pad or concatenate)."""
    layers = getattr(cache, "layers", None)
    if not layers:
        return None
    out = []
    for layer in layers:
        found = {}
        for name, v in vars(layer).items():
            if isinstance(v, torch.Tensor) and v.numel() > 0:
                if name not in CACHE_SEQ_DIMS:
                    return None
                found[name] = v
        if "keys" not in found:
            return None
        out.append(found)
    return out


def merge_cohorts(cohorts: list[Cohort]) -> Optional[Cohort]:
    """One cohort holding every row of ``cohorts``: each cache left-padded (zeros) to the longest, then
    concatenated along the batch into the first cohort's cache object. None (nothing changed) where a cache
    layout is unknown."""
    per = [cache_tensors(c.cache) for c in cohorts]
    if any(p is None for p in per) or len({len(p) for p in per}) != 1:
        return None
    L = max(c.length for c in cohorts)
    first = cohorts[0].cache
    for li, layer in enumerate(first.layers):
        for name, dim in CACHE_SEQ_DIMS.items():
            if name not in per[0][li]:
                continue
            parts = []
            for c, p in zip(cohorts, per):
                t, pad = p[li][name], L - c.length
                if pad:
                    shape = list(t.shape)
                    shape[dim] = pad
                    t = torch.cat([t.new_zeros(shape), t], dim=dim)
                parts.append(t)
            setattr(layer, name, torch.cat(parts, dim=0))
    rows = [r for c in cohorts for r in c.rows]
    pads = [p + L - c.length for c in cohorts for p in c.pads]
    return Cohort(rows, first, torch.cat([c.logits for c in cohorts]), L, pads)


def by_length(reqs: list[Request]) -> list[list[Request]]:
    """``reqs`` grouped by prompt + prefix length (first-seen order): the batches that need no padding."""
    groups: dict[int, list[Request]] = {}
    for r in reqs:
        groups.setdefault(len(r.prompt_ids) + len(r.prefix_ids), []).append(r)
    return list(groups.values())


PREFILL_COST_US = (4000.0, 15.0, 0.5)
"""(a, b, c): a prefill forward of B rows left-padded to S tokens costs about a + b·B·S + c·B·S² µs — the
forward's fixed cost, its per-token layers, its [S, S] attention and indexer scores. Fit on the tiny GLM-5
on one CPU thread (B = 64: S = 32 → 42 ms, 64 → 154 ms, 128 → 729 ms; B = 1, S = 4 → 4.4 ms). Only the
ratios matter: how much padding one forward saves is worth."""


def prefill_buckets(reqs: list[Request], cost: tuple = PREFILL_COST_US) -> list[list[Request]]:
    """``reqs`` split into prefill batches of neighbouring lengths (prompt + prefix) at the least total
    ``cost``: one padded forward for all of them pads a fresh 3-token prompt to a continued response's 130 tokens
    (measured in the fully async bench: 3.1x the real tokens, 44 % of an engine's time), one forward per length
    pays the fixed cost per distinct length. Exact over the sorted lengths (O(n²), n <= the free slots)."""
    a, b, c = cost
    order = sorted(reqs, key=lambda r: len(r.prompt_ids) + len(r.prefix_ids))
    lens = [len(r.prompt_ids) + len(r.prefix_ids) for r in order]
    best, cut = [0.0] + [float("inf")] * len(order), [0] * (len(order) + 1)
    for j in range(1, len(order) + 1):
        S = lens[j - 1]
        for i in range(j):
            total = best[i] + a + (j - i) * (b * S + c * S * S)
            if total < best[j]:
                best[j], cut[j] = total, i
    out, j = [], len(order)
    while j:
        out.append(order[cut[j]:j])
        j = cut[j]
    return out[::-1]


def zero_pad_columns(c: Cohort) -> bool:
    """Zero each row's pad columns in ``c``'s cache (a padded prefill wrote its pad tokens' keys there);
    False where the cache layout is unknown."""
    per = cache_tensors(c.cache)
    if per is None:
        return False
    for layer in per:
        for name, t in layer.items():
            for i, p in enumerate(c.pads):
                if p:
                    t.narrow(0, i, 1).narrow(CACHE_SEQ_DIMS[name] % t.dim(), 0, p).zero_()
    return True


def trim_cohort(c: Cohort) -> None:
    """Cut the left columns that are padding in every row of ``c`` (after rows left)."""
    cut = min(c.pads)
    if not cut:
        return
    for layer in c.cache.layers:
        for name, dim in CACHE_SEQ_DIMS.items():
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor) and t.numel() > 0:
                setattr(layer, name, t.narrow(dim % t.dim(), cut, t.shape[dim] - cut))
    c.pads = [p - cut for p in c.pads]
    c.length -= cut


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
        self.forwards = self.padded_forwards = 0
        """Decode forwards run, and those of them over a padded (merged) cache."""
        self.merge = True
        """Live cohorts share one padded forward (False once a cache layout could not be merged)."""

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
                c.logits, c.pads = c.logits[keep], [c.pads[i] for i in keep]
                trim_cohort(c)
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
            kw = {self.cache_kw: c.cache}
            if any(c.pads):
                mask = torch.ones(B, c.length + 1, dtype=torch.long, device=self.device)
                for i, p in enumerate(c.pads):
                    mask[i, :p] = 0
                kw["attention_mask"] = mask
                kw["position_ids"] = torch.tensor([[c.length - p] for p in c.pads], device=self.device)
            out = self.net()(input_ids=nxt, use_cache=True, **kw)
            self.forwards += 1
            self.padded_forwards += "attention_mask" in kw
            self._record(c.rows, B, 1, c.length, c.pads)
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
        groups = prefill_buckets(take) if self.merge else by_length(take)
        self.cohorts += [c for reqs in groups for c in self._prefill(reqs)]
        if self.merge and len(self.cohorts) > 1:
            merged = merge_cohorts(self.cohorts)
            if merged is None:
                self.merge = False
            else:
                self.cohorts = [merged]

    def _prefill(self, reqs: list[Request]) -> list[Cohort]:
        """One prefill forward over ``reqs`` (prompt + prefix each), left-padded to the longest (mask 0 and
        position ids of the unpadded row), the pad columns of its cache zeroed. A cache layout that cannot be
        padded turns merging off and prefills per length instead."""
        seqs = [r.prompt_ids + list(r.prefix_ids) for r in reqs]
        S = max(map(len, seqs))
        pads = [S - len(x) for x in seqs]
        ids = torch.tensor([[0] * p + x for p, x in zip(pads, seqs)], dtype=torch.long, device=self.device)
        kw = {}
        if any(pads):
            col = torch.arange(S, device=self.device)[None]
            pad_B1 = torch.tensor(pads, device=self.device)[:, None]
            kw = {"attention_mask": (col >= pad_B1).long(), "position_ids": (col - pad_B1).clamp_min(0)}
        out = self.net()(input_ids=ids, use_cache=True, **kw)
        rows = [Row(r, torch.Generator().manual_seed(r.seed), self.budget(r, self.params), list(r.prefix_ids),
                    list(r.prefix_logprobs)) for r in reqs]
        self._record(rows, len(rows), S, 0, pads)
        c = Cohort(rows, out.past_key_values, out.logits[:, -1].float(), S, pads)
        if any(pads) and not zero_pad_columns(c):
            self.merge = False
            return [c for g in by_length(reqs) for c in self._prefill(g)]
        self.prefill_tokens += sum(map(len, seqs))
        return [c]

    def _record(self, rows: list[Row], B: int, S: int, start: int, pads: Optional[list] = None) -> None:
        """This forward's routes and indexer rows over cache columns [start, start + S), split per row
        (``pads``: each row's left pad columns; a padded prefill's pad tokens have no routes)."""
        chunk = self.routes.step(B, S)
        index = self.index_rows.step(start, B, S, pads)
        for i, r in enumerate(rows):
            if chunk is not None:
                r.routes.append(chunk[i: i + 1, max(0, (pads[i] if pads else 0) - start):])
            r.index.append(index[i])

    def result(self, r: Row) -> Result:
        seen = len(r.req.prompt_ids) + len(r.toks) - 1  # tokens a forward processed (all but the last sampled)
        routes = None if not r.routes else self.routes.sample_routes(r.routes, 0, seen)
        index = self.index_rows.sample_rows([[sum(r.index, [])]], 0, seen)
        return Result(r.req.key, r.toks, r.lps, r.reason, routes=routes, index_topk=index)

"""Rollout Routing Replay (R3, arXiv 2510.11370), the engine's side: what the embedded engine records of
each sample for the trainer (``rl.train.routing`` replays it).

- ``HFRouteRecorder``: forward hooks on transformers' ``GlmMoeDsaTopkRouter`` (one per MoE layer, in layer
  order) that keep the selected expert indices of every token the embedded engine processes.
  ``sample_routes`` gives one sample's routes as ``uint8 [P + n - 1, moe_layers, top_k]`` (prompt and every
  response token but the last, which no kept log-prob depends on; ``uint16`` past 256 experts, ``route_dtype``).
- ``stash_routes`` / ``fetch_routes``: a sample's routes travel by Ray ``ObjectRef``, never through the driver
  (but for a few KB: ``rollout.routes_inline_bytes``);
  a response continued after an interruption carries ``RouteSegments`` (``continue_routes``): each token's
  routes from the engine call that sampled it.
- ``HFIndexRecorder``: the DSA indexer's selected keys of sampled query rows, for the top-k agreement check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch


def route_dtype(num_experts: int):
    return np.uint8 if num_experts <= 256 else np.uint16


class HFRouteRecorder:
    """Hooks on every ``GlmMoeDsaTopkRouter`` of an HF GLM-5 model; ``step(B, S)`` after each forward
    returns that forward's routes [B, S, L, k] (on the CPU, compact dtype)."""

    def __init__(self, model):
        self.routers = [m for m in model.modules() if type(m).__name__ == "GlmMoeDsaTopkRouter"]
        self.dtype = route_dtype(self.routers[0].num_experts) if self.routers else np.uint8
        self._cur: list = []
        for r in self.routers:
            r.register_forward_hook(self._hook)

    def _hook(self, _mod, _args, out):
        self._cur.append(out[2])  # selected expert indices [B*S, k]

    def step(self, B: int, S: int) -> Optional[np.ndarray]:
        if not self.routers:
            return None
        cur, self._cur = self._cur, []
        if len(cur) != len(self.routers):
            raise RuntimeError(f"route recorder: {len(cur)} router calls in one forward, expected {len(self.routers)}")
        idx = torch.stack([c.reshape(B, S, -1) for c in cur], dim=2)  # [B, S, L, k]
        return idx.cpu().numpy().astype(self.dtype)

    @staticmethod
    def sample_routes(chunks: list[np.ndarray], row: int, num_tokens: int) -> np.ndarray:
        """Row ``row``'s first ``num_tokens`` routes from the per-forward chunks [B, S_i, L, k]."""
        return np.ascontiguousarray(np.concatenate([c[row] for c in chunks], axis=0)[:num_tokens])


def stash_routes(results: list, inline_bytes: int = 0) -> list:
    """In a rollout actor: each sample's routes over ``inline_bytes`` (``rollout.routes_inline_bytes``) go to
    the Ray object store and the ``Result`` carries the ``ObjectRef`` (608 B per token at 744B: a step's routes
    are gigabytes, which must not pass through the driver); each trainer rank fetches only the samples it packs
    (``fetch_routes``). Smaller ones stay in the ``Result``: a ``ray.put`` costs the engine's process about a
    millisecond whatever the size (8.6 % of an HF engine's time in the fully async bench, where a sample's
    routes are under 2 KB)."""
    import ray

    for r in results:
        routes = getattr(r, "routes", None)
        if isinstance(routes, np.ndarray) and routes.nbytes > inline_bytes:
            r.routes = ray.put(routes)
    return results


@dataclass
class RouteSegments:
    """A continued response's routes (partial rollouts): ``parts`` [(routes, start, stop)], each engine
    call's own routes (an array or its ``ObjectRef``, over positions [0, its length)) cut to the positions
    that call sampled from: the prefix's tokens keep the routes that produced them, never those of the
    continuation's re-prefill (verl #6029's bug is the duplicate). ``stop`` None: to the end."""
    parts: list


def continue_routes(prev, new, prompt_len: int, prev_len: int, new_len: int):
    """The routes of a response continued from an interrupted one of ``prev_len`` tokens (``prev``: its
    routes) to ``new_len`` tokens (``new``: the continuation call's, prefix re-prefilled). Positions
    [0, prompt_len + prev_len - 1) fed the tokens the earlier calls sampled, so they come from ``prev``; the
    rest from ``new``. No new token: ``prev`` as it was (a queued request handed back unstarted)."""
    if new_len == prev_len or new is None:
        return prev if new_len == prev_len else None
    if prev is None or prev_len == 0:
        return new
    cut = prompt_len + prev_len - 1
    parts = prev.parts if isinstance(prev, RouteSegments) else [(prev, 0, None)]
    kept = [(r, a, cut if b is None else min(b, cut)) for r, a, b in parts if a < cut]
    return RouteSegments(kept + [(new, cut, None)])


def fetch_routes(r):
    """A sample's routes as an array (fetched from the Ray object store if it is an ``ObjectRef``; a
    ``RouteSegments`` concatenated from its parts)."""
    if r is None or isinstance(r, np.ndarray):
        return r
    if isinstance(r, RouteSegments):
        return np.ascontiguousarray(np.concatenate([fetch_routes(x)[a:b] for x, a, b in r.parts], axis=0))
    import ray

    return ray.get(r)


class HFIndexRecorder:
    """Forward hooks on transformers' ``GlmMoeDsaIndexer`` layers (those that compute a top-k): keeps the
    selected keys of sampled query rows — positions p >= index_topk (where selection is a real choice)
    with (p - index_topk) % ``stride`` == 0 — so the trainer can check it selects the same key sets."""

    def __init__(self, model, stride: int):
        self.indexers = [m for m in model.modules() if type(m).__name__ in ("GlmMoeDsaIndexer", "DeterministicIndexer")]
        self.K = self.indexers[0].index_topk if self.indexers else 0
        self.stride = max(1, int(stride))
        self._cur: list = []
        for m in self.indexers:
            m.register_forward_hook(lambda _m, _a, out: self._cur.append(out))

    def step(self, start: int, B: int, S: int, pads: Optional[list] = None) -> list:
        """After a forward over cache columns [start, start + S): per row b, [(pos, [Li, K] int32)], positions
        and keys the row's own (``pads[b]`` left pad columns taken off; a recorded row has more than K real
        keys, so a masked pad column is never among its top-k)."""
        cur, self._cur = self._cur, []
        if not self.indexers:
            return [[] for _ in range(B)]
        out = []
        for b, pad in enumerate(pads or [0] * B):
            keep = [s for s in range(S) if start + s - pad >= self.K and (start + s - pad - self.K) % self.stride == 0]
            if not keep:
                out.append([])
                continue
            idx = (torch.stack([c[b, keep] for c in cur], dim=1).to(torch.int32) - pad).cpu().numpy()  # [m, Li, K]
            out.append([(start + s - pad, idx[j]) for j, s in enumerate(keep)])
        return out

    @staticmethod
    def sample_rows(steps: list, row: int, num_tokens: int) -> Optional[tuple]:
        """(positions int32 [m], keys int32 [m, Li, K]) of row ``row`` over positions < ``num_tokens``."""
        rows = [(p, k) for st in steps for p, k in st[row] if p < num_tokens]
        if not rows:
            return None
        return np.asarray([p for p, _ in rows], dtype=np.int32), np.stack([k for _, k in rows])

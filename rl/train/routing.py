"""Rollout Routing Replay (R3, arXiv 2510.11370), the trainer's side: the experts the rollout engine chose
(recorded by ``rl.rollout.routes``) travel with each sample and the trainer routes through exactly those
(routing weights still from its live router); and the DSA top-k agreement of the trainer with the engine.

- ``pack_routes``: a micro-batch's routes in the trainer's THD token order, [T, L, k] int64, plus a
  [T] mask of the tokens that have engine routes (the last token of each sample and filler documents get
  the placeholder experts 0..k-1: causal attention means nothing read depends on them).
- ``TrainerRouting``: drives Megatron-Core's own ``RouterReplay`` (``moe_enable_routing_replay``) on the
  routers of one model: ``REPLAY_FORWARD`` with the packed routes (old, reference and update forwards;
  recompute reads the same target), else ``RECORD``; either way it keeps the trainer's own top-k so
  ``rollout_corr/router_agree`` (the fraction of (token, MoE layer) expert sets the trainer would choose
  itself that equal the engine's) is known with replay on or off.
- ``index_topk_counts``: how many sampled query rows' DSA top-k key sets the trainer shares with the engine
  (``rollout_corr/index_topk_agree``).
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from rl.rollout.routes import fetch_routes


def pack_routes(routes: list, prompts: list, responses: list, rows: list[int], num_tokens: int, L: int,
                top_k: int):
    """(routes [T, L, k] int64, valid [T] bool) for samples ``rows`` packed back to back (THD order), with
    ``num_tokens`` the micro-batch's padded length; ``routes[i]`` is sample i's [P + n - 1, L, k]."""
    out = torch.arange(top_k, dtype=torch.long).expand(num_tokens, L, top_k).clone()
    valid = torch.zeros(num_tokens, dtype=torch.bool)
    off = 0
    for i in rows:
        r = fetch_routes(routes[i])
        n_seq = len(prompts[i]) + len(responses[i])
        if r.ndim != 3 or r.shape[0] > n_seq or r.shape[1:] != (L, top_k):
            raise ValueError(f"sample {i}: routes {tuple(r.shape)} do not fit {n_seq} tokens x {L} MoE layers x "
                             f"top-{top_k}")
        out[off: off + r.shape[0]] = torch.from_numpy(r.astype(np.int64))
        valid[off: off + r.shape[0]] = True
        off += n_seq
    return out, valid


class _KeepOwnReplay:
    """Mixin for ``RouterReplay``: while replaying, also record the top-k the router would pick itself."""

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if self.router_replay_action in (RouterReplayAction.REPLAY_FORWARD, RouterReplayAction.REPLAY_BACKWARD):
            with torch.no_grad():
                self.record_indices(default_compute_topk(scores, topk, num_groups=num_groups,
                                                         group_topk=group_topk)[1])
        return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)


class TrainerRouting:
    """Megatron-Core ``RouterReplay`` on one model's routers (built with ``moe_enable_routing_replay``),
    in layer order; only this model's instances are touched (not the process-wide list)."""

    def __init__(self, model, replay: bool):
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay

        # the decoder's MoE layers (the engine's routes); an MTP layer's router routes on its own
        routers = [m for n, m in model.named_modules() if isinstance(m, TopKRouter) and not n.startswith("mtp.")]
        if any(r.router_replay is None for r in routers):
            raise ValueError("TrainerRouting: build the model with moe_enable_routing_replay=True")
        self.routers = routers  # module order = layer order
        self.instances = [r.router_replay for r in self.routers]
        cls = type("KeepOwnRouterReplay", (_KeepOwnReplay, RouterReplay), {})
        for inst in self.instances:
            inst.__class__ = cls
        self.replay = replay
        self.top_k = self.routers[0].topk if self.routers else 0

    def tp_slice(self, t: torch.Tensor) -> torch.Tensor:
        """This TP rank's tokens under sequence parallelism (the router sees [T/TP, H])."""
        from megatron.core import parallel_state as ps

        cfg = self.routers[0].config
        tp = ps.get_tensor_model_parallel_world_size()
        if cfg.sequence_parallel and tp > 1:
            n = t.shape[0] // tp
            r = ps.get_tensor_model_parallel_rank()
            return t[r * n: (r + 1) * n]
        return t

    def prepare(self, routes: Optional[torch.Tensor], device) -> None:
        """Before a forward: replay ``routes`` [T, L, k] (if replay is on), else record own routing."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for inst in self.instances:
            inst.clear_indices()
        if self.replay:
            if routes is None:
                raise ValueError("algorithm.router_replay=true: the rollout engine returned no routes for this "
                                 "batch (the HF engine records them; vLLM needs enable_return_routed_experts)")
            loc = self.tp_slice(routes).to(device)
            if loc.shape[1] != len(self.instances):
                raise ValueError(f"routes have {loc.shape[1]} MoE layers, the trainer has {len(self.instances)}")
            for j, inst in enumerate(self.instances):
                inst.set_target_indices(loc[:, j].contiguous())
                inst.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        else:
            for inst in self.instances:
                inst.set_router_replay_action(RouterReplayAction.RECORD)

    def own_routes(self) -> torch.Tensor:
        """The trainer's own top-k of the last forward, [T_local, L, k]."""
        return torch.stack([inst.get_recorded_indices() for inst in self.instances], dim=1)

    def agreement(self, routes: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """[agreeing, total] (token, MoE layer) expert sets of the last forward vs the engine's ``routes``
        over ``valid`` tokens, summed over the TP ranks that split the tokens (float64 [2])."""
        from megatron.core import parallel_state as ps

        own = self.own_routes()
        eng = self.tp_slice(routes).to(own.device)
        v = self.tp_slice(valid).to(own.device)
        same = (own.sort(-1).values == eng.sort(-1).values).all(-1)[v]  # [n_valid, L]
        out = torch.tensor([float(same.sum()), float(same.numel())], dtype=torch.float64, device=own.device)
        if self.routers[0].config.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1:
            torch.distributed.all_reduce(out, group=ps.get_tensor_model_parallel_group())
        return out

    def clear(self) -> None:
        for inst in self.instances:
            inst.clear_indices()
            inst.clear_router_replay_action()


def router_metrics(outputs: list[dict]) -> dict:
    """``rollout_corr/router_agree`` from the trainer ranks' [agreeing, total] counts (None-free outputs)."""
    counts = [o["router_agree"] for o in outputs if o is not None and o.get("router_agree") is not None]
    if not counts:
        return {}
    tot = torch.stack([torch.as_tensor(c, dtype=torch.float64) for c in counts]).sum(0)
    return {"rollout_corr/router_agree": float(tot[0] / tot[1]) if tot[1] > 0 else float("nan")}


def index_topk_counts(model, batch, rows: list[int], cp_split=None) -> torch.Tensor:
    """[agreeing, total] sampled query rows (× indexer layers) whose top-k key set the trainer's last
    forward (``GLM5SparseAttention.last_topk``, packed THD keys) shares with the engine's
    (``batch.index_topk``); float64 [2]. ``cp_split``: the micro-batch split over CP ranks (``rl.train.cp``):
    only the query rows this rank holds count, their keys mapped from the padded gathered order back
    to the unsplit pack (the caller sums the CP ranks' counts)."""
    from glm5_mcore.model.dsa import GLM5SparseAttention

    layers = [m for m in model.modules() if isinstance(m, GLM5SparseAttention) and m.computes_topk]
    dev = next((m.last_topk.device for m in layers if m.last_topk is not None), torch.device("cpu"))
    out = torch.zeros(2, dtype=torch.float64, device=dev)  # counted where the top-k lives: one copy at the end
    unsplit = cp_split.unsplit_of_padded.to(dev) if cp_split is not None else None
    off = 0
    for i in rows:
        rec = batch.index_topk[i] if batch.index_topk is not None else None
        n_seq = len(batch.prompts[i]) + len(batch.responses[i])
        if rec is not None and layers:
            pos, keys = rec  # rows p >= index_topk: both sides pick exactly K distinct keys
            p = torch.from_numpy(pos.astype(np.int64))
            here = torch.ones(p.numel(), dtype=torch.bool)
            if cp_split is not None:  # the rows this CP rank holds, their local index
                loc = cp_split.local_of[off + p]
                here = loc >= 0
                rows_d = loc[here].to(dev)
            else:
                rows_d = (off + p).to(dev)
            eng_all = torch.from_numpy(keys[here.numpy()].astype(np.int64)).to(dev)  # [m, Li, K], one copy
            for li, layer in enumerate(layers[: keys.shape[1]]):
                if layer.last_topk is None:  # dense: only possible when no row has more than K keys
                    continue
                got = layer.last_topk[0][rows_d]
                mine = (got if unsplit is None else unsplit[got]) - off  # [m, K]
                same = (mine.sort(-1).values == eng_all[:, li].sort(-1).values).all(-1)
                out[0] += same.sum()
                out[1] += same.numel()
        off += n_seq
    return out.cpu()


def index_metrics(outputs: list[dict]) -> dict:
    counts = [o["index_topk_agree"] for o in outputs if o is not None and o.get("index_topk_agree") is not None]
    if not counts:
        return {}
    tot = torch.stack([torch.as_tensor(c, dtype=torch.float64) for c in counts]).sum(0)
    return {"rollout_corr/index_topk_agree": float(tot[0] / tot[1]) if tot[1] > 0 else float("nan")}

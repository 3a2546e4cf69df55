"""The embedded rollout engine: transformers' ``GlmMoeDsaForCausalLM`` with the adapter loaded
through ``peft`` — the HF PEFT folder ``glm5 lora export`` writes is also the weight-sync format.

Two ways to decode. ``generate``: a static batch per prompt + prefix length (no padding, so no position
or mask games: a finished row just keeps decoding filler that nobody reads, until the batch's longest
response ends). ``stream_submit`` / ``stream_poll``: continuous decoding over ``max_num_seqs`` slots
(``rl.rollout.hf_slots``), each response returned the token it finishes and its slot refilled. Both: per-request
``torch.Generator`` sampling with temperature and top-p, stop tokens, a token budget. With
``deterministic_topk`` the indexer selects its top-k with ``glm5_mcore.model.sparse_attention.deterministic_topk`` (ties
to the lower index), the same rule as the trainer.
"""

from __future__ import annotations

import inspect
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

from glm5_mcore.device import HostCopy, device_memory
from rl.rollout.base import (AdapterPayload, Occupancy, Request, Result, RolloutEngine, SamplingParams,
                             check_sleep_level, check_wake_tags, token_seed)
from rl.rollout.draft import adapter_without_mtp
from rl.rollout.hf_merge import MergedLoRA
from rl.rollout.hf_slots import SlotDecoder, top_p_probs
from rl.rollout.routes import HFIndexRecorder, HFRouteRecorder


def _deterministic_indexer_class():
    """``GlmMoeDsaIndexer`` with transformers' ``index_scores.topk`` replaced by the trainer's
    tie-stable top-k (modeling_glm_moe_dsa.py, ``GlmMoeDsaIndexer.forward``, transformers 5.24)."""
    from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as hf

    from glm5_mcore.model.sparse_attention import deterministic_topk

    class DeterministicIndexer(hf.GlmMoeDsaIndexer):
        def forward(self, hidden_states, q_resid, position_embeddings, attention_mask, position_ids=None,
                    cache=None, **kwargs):
            if cache is None:
                cache = kwargs.get("past_key_values")
            b, s, _ = hidden_states.shape
            cos, sin = position_embeddings
            q = self.wq_b(q_resid).view(b, s, self.n_heads, self.head_dim)
            q_rot, q_pass = torch.split(q, [self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim], dim=-1)
            k = self.k_norm(self.wk(hidden_states)).unsqueeze(2)
            k_rot, k_pass = torch.split(k, [self.qk_rope_head_dim, self.head_dim - self.qk_rope_head_dim], dim=-1)
            q_rot, k_rot = hf.apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
            q = torch.cat([q_rot, q_pass], dim=-1)
            k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
            if cache is not None:
                k = cache.update_indexer(k, self.layer_idx)
            scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * self.softmax_scale)
            weights = self.weights_proj(hidden_states.to(self.weights_proj.weight.dtype)).float() * self.n_heads ** -0.5
            index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
            if attention_mask.dtype == torch.bool:
                index_scores = index_scores.masked_fill(~attention_mask, float("-inf"))
            else:
                index_scores = index_scores + attention_mask
            idx = deterministic_topk(index_scores, min(self.index_topk, index_scores.shape[-1]))
            # rows with fewer than k causal keys: pad with a selected (valid) key, as the mask ignores repeats;
            # a left-padded prefill's pad rows have none (key 0: the row is masked whole)
            return torch.where(idx < 0, idx.max(-1, keepdim=True).values.clamp_min(0), idx).to(torch.int32)

    return DeterministicIndexer


class HFRolloutEngine(RolloutEngine):
    DTYPES = ("float32", "bfloat16", "float16")
    INTERRUPTIBLE = True
    STREAMS = True
    STATIC_GENERATE = True  # generate decodes each batch to its longest response: every mode streams by default

    def __init__(self, hf_dir: str, deterministic_topk: bool = True, dtype: str = "float32", threads: int = 1,
                 index_row_stride: int = 1024, max_num_seqs: int = 64, stream: bool = True, merge_lora: bool = True):
        """``merge_lora``: each adapter merged into the base weights as it loads (``rl.rollout.hf_merge``: a
        decode forward 1.5x faster on the tiny model); false: PEFT's unmerged layers."""
        super().__init__(hf_dir, deterministic_topk)
        self.check_kwargs({"dtype": dtype, "threads": threads, "index_row_stride": index_row_stride,
                           "max_num_seqs": max_num_seqs, "stream": stream, "merge_lora": merge_lora})
        from transformers import AutoModelForCausalLM

        from glm5_mcore.device import training_device

        torch.set_num_threads(threads)
        self.device = training_device()  # the GPU a Ray actor is given (CUDA_VISIBLE_DEVICES), else the CPU
        self.model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype)).eval().to(self.device)
        if deterministic_topk:
            cls = _deterministic_indexer_class()
            for m in self.model.modules():
                if type(m).__name__ == "GlmMoeDsaIndexer":
                    m.__class__ = cls
        self.max_positions = self.model.config.max_position_embeddings
        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = "past_key_values" if "past_key_values" in params else "cache"
        """The KV-cache keyword of this transformers' forward: ``past_key_values`` up to 5.19 (the GPU image's
        5.17), ``cache`` from 5.24; the other name would land in ``**kwargs`` and decode without a cache."""

        self.routes = HFRouteRecorder(self.model)  # R3: each token's experts travel with its sample
        self.index_rows = HFIndexRecorder(self.model, index_row_stride)  # DSA top-k of sampled query rows
        self.peft = None
        self.merge_lora = merge_lora
        self.merged: Optional[MergedLoRA] = None  # the pristine base of the LoRA-targeted tensors, once loaded
        self.adapter_version: Optional[int] = None
        self._asleep: Optional[HostCopy] = None
        self._interrupt = threading.Event()
        self._running = threading.Lock()  # held by generate: interrupt() outside it is a no-op
        self.occupancy = Occupancy(max_num_seqs)
        self.slots = SlotDecoder(lambda: self._net, self.cache_kw, self.routes, self.index_rows, self.device,
                                 max_num_seqs, lambda r, p: self.response_budget(r, p))
        self.payload_version = -1
        """The ``AdapterPayload.version`` loaded (-1: none yet): what a stream ``Result.version`` reports."""
        self._stream_stop = threading.Event()  # sticky while the stream holds work (see interrupt)
        self._deferred: Optional[tuple] = None  # (payload,): an adapter (None: the base) waiting for the live rows

    @classmethod
    def check_kwargs(cls, kwargs: dict) -> None:
        super().check_kwargs(kwargs)
        if kwargs.get("dtype", "float32") not in cls.DTYPES:
            raise ValueError(f"rollout.engine_kwargs.dtype={kwargs['dtype']!r}: one of {cls.DTYPES}")
        for key in ("stream", "merge_lora"):
            if not isinstance(kwargs.get(key, True), bool):
                raise ValueError(f"rollout.engine_kwargs.{key}={kwargs[key]!r} must be true or false")
        for key in ("threads", "index_row_stride", "max_num_seqs"):
            v = kwargs.get(key, 1)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"rollout.engine_kwargs.{key}={v!r} must be an integer >= 1")

    def interrupt(self) -> bool:
        """A running ``generate`` stops at its next token boundary; the stream, while it holds work, hands
        back every live row and queued request as ``"interrupted"`` at its next ``stream_poll`` (sticky: an
        interrupt between two polls is not lost)."""
        if self._running.locked():
            self._interrupt.set()
        if self.slots.has_work():
            self._stream_stop.set()
        return True

    # ------------------------------------------------------------------ the stream (continuous decoding)
    def response_budget(self, request: Request, params: SamplingParams) -> int:
        """The response tokens (prefix included) ``request`` may hold: ``params.max_new_tokens``."""
        return params.max_new_tokens

    def stream_submit(self, requests: list[Request], params: SamplingParams) -> None:
        """Queue ``requests`` for the slots (checked as ``generate`` checks them); ``stream_poll`` decodes."""
        for r in requests:
            if len(r.prompt_ids) + params.max_new_tokens > self.max_positions:
                raise ValueError(f"request {r.key}: prompt {len(r.prompt_ids)} + max_new_tokens "
                                 f"{params.max_new_tokens} exceeds max_position_embeddings={self.max_positions}")
            r.check_prefix(params.max_new_tokens)
        self.slots.submit(requests, params)

    @torch.no_grad()
    def stream_poll(self, timeout_s: float = 0.25) -> list[Result]:
        """Decode token by token until at least one response finishes, ``timeout_s`` passes, or an interrupt
        (then every live row and queued request comes back ``"interrupted"``). Each ``Result.version`` is the
        adapter its new tokens were sampled under: an adapter loaded while rows are live waits until they
        have finished (admission holds meanwhile), so no response spans two adapters without an interrupt."""
        t_end = time.perf_counter() + timeout_s
        out: list[Result] = []
        with self._running:
            if not self.slots.has_work():
                self.slots.wait_for_work(timeout_s)
            while not out and time.perf_counter() < t_end:
                if self._stream_stop.is_set():
                    out = self.slots.drain()
                    for r in out:
                        r.version = self.payload_version
                    break
                self._install_deferred()
                if not self.slots.has_work():
                    break
                out = self.slots.step(self.occupancy)
                for r in out:  # before a deferred adapter is installed below
                    r.version = self.payload_version
                if self.slots.cohorts and not self._stream_stop.is_set():
                    self.slots.forward(self.occupancy)
            if not self.slots.has_work():
                self._stream_stop.clear()
            self._install_deferred()
        return out

    def _install_deferred(self) -> None:
        if self._deferred is not None and not self.slots.cohorts:
            (payload,), self._deferred = self._deferred, None
            self._load(payload)
            self.slots.hold = False

    def take_occupancy(self) -> dict:
        """Live rows / ``max_num_seqs``, time-averaged since the last call (``Occupancy.take``), both paths."""
        return self.occupancy.take()

    # ------------------------------------------------------------------ weights
    def load_adapter(self, payload: Optional[AdapterPayload]) -> None:
        """Install the PEFT adapter in ``payload`` (None or no files: run the base model). Its MTP-layer
        tensors, if any, are dropped: transformers' GLM-5 has no MTP module, so this engine never drafts.
        While stream rows are live the load waits for them (``stream_poll``): a row never spans two adapters."""
        if self.slots.cohorts:
            self._deferred, self.slots.hold = (payload,), True
            return
        self._deferred = None
        self._load(payload)

    def _load(self, payload: Optional[AdapterPayload]) -> None:
        from peft import PeftModel, set_peft_model_state_dict
        from safetensors.torch import load as load_bytes

        self.payload_version = payload.version if payload is not None else -1
        if self.merged is not None:
            self.merged.restore()
        if payload is None or not payload.files:
            if self.peft is not None:
                self.peft.base_model.disable_adapter_layers()
            self.adapter_version = None
            return
        files = adapter_without_mtp(payload.files, self.model.config.num_hidden_layers)
        payload = AdapterPayload(payload.version, files)
        if self.peft is None:
            with tempfile.TemporaryDirectory() as d:
                for name, data in payload.files.items():
                    Path(d, name).write_bytes(data)
                self.peft = PeftModel.from_pretrained(self.model, d).eval()
        else:
            self.peft.base_model.enable_adapter_layers()
            res = set_peft_model_state_dict(self.peft, load_bytes(payload.files["adapter_model.safetensors"]))
            if getattr(res, "unexpected_keys", None):
                raise ValueError(f"adapter v{payload.version}: unexpected keys {res.unexpected_keys[:3]}")
        if self.merge_lora:
            if self.merged is None:
                self.merged = MergedLoRA(self.peft)
            self.merged.merge()
        self.adapter_version = payload.version

    # ------------------------------------------------------------------ colocation (rl.schedule.colocate)
    def sleep(self, level: int) -> str:
        """On CUDA: every weight (base and adapter) to pinned host memory (``glm5_mcore.device.HostCopy``); this
        engine keeps no KV cache between calls, and level 2 is served as level 1 (no path reloads the base
        from disk here). On the CPU: the base class's logged no-op."""
        check_sleep_level(level)
        if self.device.type != "cuda":
            return super().sleep(level)
        if self._asleep is None:
            self._asleep = HostCopy([*self.model.parameters(), *self.model.buffers()])
            moved = self._asleep.offload()
            torch.cuda.empty_cache()
        else:
            moved = 0
        return f"HFRolloutEngine.sleep(level={level}): {moved / 2 ** 20:.1f} MiB to host, {device_memory()}"

    def wake_up(self, tags: tuple = ("weights", "kv_cache")) -> str:
        check_wake_tags(tags)
        if self.device.type != "cuda":
            return super().wake_up(tags)
        moved = 0
        if "weights" in tags and self._asleep is not None:
            moved = self._asleep.restore()
            self._asleep = None
        return f"HFRolloutEngine.wake_up(tags={list(tags)}): {moved / 2 ** 20:.1f} MiB back, {device_memory()}"

    @property
    def _net(self):
        return self.peft if self.peft is not None else self.model

    # ------------------------------------------------------------------ sampling
    @torch.no_grad()
    def generate(self, requests: list[Request], params: SamplingParams, batched: bool = True) -> list[Result]:
        """Requests batched by prompt + prefix length. After ``interrupt`` the groups not started yet come
        back with their prefix as ``"interrupted"`` results (continued later, like the started ones)."""
        groups: dict = defaultdict(list)
        for r in requests:
            if len(r.prompt_ids) + params.max_new_tokens > self.max_positions:
                raise ValueError(f"request {r.key}: prompt {len(r.prompt_ids)} + max_new_tokens "
                                 f"{params.max_new_tokens} exceeds max_position_embeddings={self.max_positions}")
            r.check_prefix(params.max_new_tokens)
            n = len(r.prompt_ids) + len(r.prefix_ids)
            groups[n if batched else (n, r.key[0])].append(r)
        out = {}
        with self._running:
            self._interrupt.clear()
            for reqs in groups.values():
                if self._interrupt.is_set():
                    done = [Result(r.key, list(r.prefix_ids), list(r.prefix_logprobs), "interrupted") for r in reqs]
                else:
                    done = self._decode(reqs, params)
                for res in done:
                    out[res.key] = res
            self._interrupt.clear()
        return [out[r.key] for r in requests]

    def _decode(self, reqs: list[Request], p: SamplingParams) -> list[Result]:
        """Rows of equal prompt + prefix length. ``p.seed_per_token``: token ``t`` of row ``i`` is drawn
        with a generator seeded ``token_seed(seed_i, t)`` (t counts the prefix); otherwise one running
        generator per request (its state after t draws), as before partial rollouts existed."""
        B = len(reqs)
        gens = [torch.Generator().manual_seed(r.seed) for r in reqs]
        stop = set(int(t) for t in p.stop_token_ids)
        start = [len(r.prefix_ids) for r in reqs]
        budget = p.max_new_tokens - min(start)  # rows of one group may hold prefixes of other lengths
        ids = torch.tensor([r.prompt_ids + list(r.prefix_ids) for r in reqs], dtype=torch.long, device=self.device)
        t0 = time.perf_counter()
        out = self._net(input_ids=ids, use_cache=True)
        self.occupancy.add(B, time.perf_counter() - t0)
        chunks = [self.routes.step(B, ids.shape[1])]
        index_steps = [self.index_rows.step(0, B, ids.shape[1])]
        cache = out.past_key_values
        logits = out.logits[:, -1].float()
        toks: list[list[int]] = [list(r.prefix_ids) for r in reqs]
        lps: list[list[float]] = [list(r.prefix_logprobs) for r in reqs]
        done = [False] * B
        reason = ["length"] * B
        for t in range(budget):
            t0, live = time.perf_counter(), B - sum(done)
            # sampled on the CPU with each request's CPU generator: the same tokens on any device
            logp = torch.log_softmax(logits / p.temperature, dim=-1).cpu()
            probs = top_p_probs(logits, p.temperature, p.top_p).cpu()
            nxt = torch.zeros(B, dtype=torch.long)
            for i in range(B):
                if done[i]:
                    continue
                if p.seed_per_token:
                    gens[i].manual_seed(token_seed(reqs[i].seed, start[i] + t))
                tok = int(torch.multinomial(probs[i], 1, generator=gens[i]))
                nxt[i] = tok
                toks[i].append(tok)
                lps[i].append(float(logp[i, tok]))
                if tok in stop:
                    done[i], reason[i] = True, "stop"
                elif len(toks[i]) == p.max_new_tokens:
                    done[i] = True
            if all(done) or t == budget - 1:
                break
            if self._interrupt.is_set():  # a weight push: stop at this token boundary
                reason = ["interrupted" if not d else why for d, why in zip(done, reason)]
                break
            out = self._net(input_ids=nxt[:, None].to(self.device), use_cache=True, **{self.cache_kw: cache})
            chunks.append(self.routes.step(B, 1))
            index_steps.append(self.index_rows.step(ids.shape[1] + t, B, 1))
            cache = out.past_key_values
            logits = out.logits[:, -1].float()
            self.occupancy.add(live, time.perf_counter() - t0)
        routes = [None] * B if chunks[0] is None else [
            self.routes.sample_routes(chunks, i, len(r.prompt_ids) + len(toks[i]) - 1) for i, r in enumerate(reqs)]
        index = [self.index_rows.sample_rows(index_steps, i, len(r.prompt_ids) + len(toks[i]) - 1)
                 for i, r in enumerate(reqs)]
        return [Result(r.key, toks[i], lps[i], reason[i], routes=routes[i], index_topk=index[i]) for i, r in enumerate(reqs)]

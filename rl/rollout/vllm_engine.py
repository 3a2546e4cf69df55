"""vLLM rollout engine (vLLM 0.32, the GPU extra; vLLM's CPU build in tests): token ids in, ids +
log-probs out.

vLLM itself runs in ``rl.rollout.vllm_server``: in this process, or, with ``vllm_python``, in a child
process under that interpreter (an environment of its own: vLLM pins torch / transformers versions
the trainer's need not share; ``setup_vllm_cpu.sh`` makes ``.venv-vllm`` so for the CPU tests).

The adapter arrives as the same HF PEFT payload the embedded engine loads and is served as a
``LoRARequest`` (a new id per version). Where vLLM's GLM-5 LoRA support falls short (its LoRA path
forces the Triton fused-MoE backend: GPU only; routed-expert adapters, which LoRA mode refuses in one line
naming ``merge: true``, at validation and at push), ``merge=True`` folds the adapter into the base weights on
the host instead, pushing only the modules a non-zero adapter touches — ``rl.rollout.vllm_weights.merged_weights``: W + scale·B·A per adapted HF
tensor, from the base shards (never cumulative, so a second push replaces the first), in the dtype the
served folder stores, FP8 block-quantized (``glm5_mcore.checkpoint.fp8``) where it stores FP8 — written to a
safetensors file that vLLM's workers ``reload_weights`` from.

Log-probs are vLLM's ``processed_logprobs`` (after temperature, the distribution the token was drawn
from): with ``top_p < 1`` vLLM renormalises over the nucleus, so this engine refuses ``top_p < 1``
rather than hand IcePop a different quantity. vLLM picks its own DSA top-k kernel; its tie rule is
not ours, so ``deterministic_topk`` is reported as unsupported (a warning), and IcePop's mismatch
metrics show the effect.

Partial rollouts (``trainer.partial_rollout``, ``rl.schedule.async_source``): ``interrupt`` (another thread) ends a
running ``generate`` at vLLM's next step — the server aborts the unfinished requests
(``vllm_server.Server.generate``) and they return what they sampled, ``"interrupted"``; a request with
``prefix_ids`` is resubmitted as prompt + prefix with the rest of the token budget, under the adapter loaded
since, seeded ``request_seed(seed, len(prefix))``. The channel to the server is ``rl.rollout.vllm_client``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Optional

import torch
from safetensors import safe_open

from rl.rollout import weight_sync
from rl.rollout.base import (AdapterPayload, Occupancy, Request, Result, RolloutEngine, SamplingParams,
                             check_sleep_level, check_wake_tags)
from rl.rollout.draft import adapter_without_mtp, mtp_speculative_config
from rl.rollout.routes import route_dtype
from rl.rollout.vllm_client import LocalServer, RemoteServer
from rl.rollout.vllm_stream import EngineStream, to_result, vllm_sampling
from rl.rollout.vllm_weights import (HF_LAYER, LORA_MODE_EXPERTS, MLA_UP_KV, ROUTED_ADAPTER, check_lora_targets,
                                     default_push_threads, is_mla_up_kv, is_mtp_tensor, iter_merged_weights)


class VLLMRolloutEngine(RolloutEngine):
    """``engine_kwargs``: ``merge`` (push merged weights instead of a LoRARequest), ``dtype``,
    ``vllm_python`` (run vLLM under that interpreter), ``device="cpu"`` (vLLM's CPU build:
    ``cpu_compat.vllm_cpu_llm_kwargs``), ``dense_mla`` (serve without the DSA indexer: only while
    ``index_topk`` >= ``max_model_len``, where DSA selects every key), ``push_bytes`` (merged tensors per
    reload), ``sleep_mode`` (vLLM's, for colocated engines), ``weight_transport`` ("file": safetensors files,
    separate engines; "handles": ``rl.rollout.weight_sync`` buckets, CUDA IPC on GPUs, colocated engines), ``return_routes`` (R3: vLLM's ``enable_return_routed_experts``, which in vLLM 0.32 needs model
    runner V2 and prefix caching, so GPU only; each ``Result.routes`` is then uint8 [tokens, moe_layers,
    top_k]), ``mtp_draft_tokens`` (> 0: speculative decoding, that many tokens drafted per step by the
    checkpoint's MTP layer — vLLM's ``speculative_config`` ``method="mtp"``), ``push_threads`` (CPU threads
    of a merged push; default ``default_push_threads``), ``push_dir`` (where the merged files go: a folder every
    node of an engine spanning nodes sees; ``rl.cluster.engine_placement``), anything else goes to ``vllm.LLM``.

    LoRA mode (``merge=False``) sends the adapter as a ``LoRARequest`` except for ``linear_kv_up_proj``
    (``MLA_UP_KV``), which vLLM's MLA would silently ignore: that module is merged and reloaded as in
    merged mode. Every reload drops vLLM's prefix cache (``vllm_server.Server.reload``).

    The draft head follows the trained one: vLLM builds the MTP layer as a separate draft model that
    neither ``reload_weights`` (the decoder's loader skips ``model.layers.{num_hidden_layers}.*``) nor a
    ``LoRARequest`` (vLLM applies LoRA to the decoder only) reaches. So, while drafting, every push
    also merges the payload's MTP-layer adapter (``W + scale·B·A``, whole vLLM modules, as for the
    decoder) and reloads it into the draft model (``vllm_server.Server.reload_draft``) — in merged and
    LoRA mode alike; the LoRARequest carries the decoder's adapter only."""

    FORWARDS_KWARGS = True  # the rest go to vllm.LLM, whose EngineArgs refuses unknown keys
    check_lora_targets = staticmethod(check_lora_targets)  # run by rl.validate with lora.targets
    SPANS_BUNDLES = True  # distributed_executor_backend="ray" over the bundles rl.cluster.engine_placement names
    INTERRUPTIBLE = True
    STREAMS = True  # rl.rollout.vllm_stream: vLLM's scheduler loop kept running across calls

    def __init__(self, hf_dir: str, deterministic_topk: bool = True, merge: bool = False, max_lora_rank: int = 64,
                 dtype: str = "bfloat16", gpu_memory_utilization: float = 0.8, tensor_parallel_size: int = 1,
                 vllm_python: Optional[str] = None, dense_mla: bool = False, device: Optional[str] = None,
                 push_bytes: int = 2 << 30, return_routes: bool = False, mtp_draft_tokens: int = 0,
                 push_threads: Optional[int] = None, sleep_mode: bool = False, weight_transport: str = "file",
                 push_dir: Optional[str] = None, stream: bool = True, **kwargs):
        """``stream``: async RL uses continuous generation (``rl.cluster.rollout_pool.engine_streams``); the
        other keywords not named here go to ``vllm.LLM``."""
        super().__init__(hf_dir, deterministic_topk)
        if not isinstance(stream, bool):
            raise ValueError(f"rollout.engine_kwargs.stream={stream!r} must be true or false")
        config = json.loads((Path(hf_dir) / "config.json").read_text())
        if dense_mla:
            topk, max_len = config.get("index_topk"), kwargs.get("max_model_len")
            if max_len is None or topk is None or topk < max_len:
                raise ValueError(f"dense_mla: serving GLM-5 without its indexer equals GLM-5 only while "
                                 f"index_topk ({topk}) >= max_model_len ({max_len})")
        elif deterministic_topk:
            warnings.warn("vLLM selects DSA top-k with its own kernel; the trainer's tie rule is not enforced")
        self.merge = merge

        self.route_dtype = route_dtype(int(config.get("n_routed_experts") or config.get("num_local_experts") or 256))
        self.push_bytes = push_bytes
        self.push_threads = int(push_threads or default_push_threads())
        self.num_hidden_layers = int(config["num_hidden_layers"])
        self.drafts = bool(mtp_draft_tokens)
        self.device = device
        self.lora: Optional[tuple] = None
        self._pushed: set[str] = set()
        self.sleep_mode = sleep_mode and device != "cpu"  # cpu_compat.VLLM_CPU_NO_SLEEP
        if weight_transport not in ("file", "handles"):
            raise ValueError(f"weight_transport={weight_transport!r}: file (separate engines) or handles "
                             "(colocated: rl.rollout.weight_sync buckets, CUDA IPC on GPUs)")
        self.transport = weight_transport
        self.n_experts = int(config.get("n_routed_experts") or 1)
        self.sync_log: list[dict] = []  # per push: buckets and bytes (handles transport)
        self._call_lock = threading.Lock()  # generate's call number vs interrupt (another thread)
        self._calls, self._running, self._stop_after = 0, None, None
        self._discarded = False  # a level-2 sleep: the next push brings every weight back
        self.stream = EngineStream()
        self.occupancy = Occupancy(int(kwargs.get("max_num_seqs") or 256))  # vLLM's default max_num_seqs
        self.payload_version = -1  # the AdapterPayload.version loaded (what a stream Result.version reports)
        self._deferred: Optional[tuple] = None  # (payload,): a push waiting for the live stream requests
        env: dict = {}
        llm = dict(model=str(hf_dir), dtype=dtype, enable_lora=not merge, tensor_parallel_size=tensor_parallel_size,
                   logprobs_mode="processed_logprobs", enable_prefix_caching=False)
        if return_routes:
            llm.update(enable_return_routed_experts=True, enable_prefix_caching=True)
        if self.sleep_mode:  # colocated with the trainer (rl.schedule.colocate)
            llm["enable_sleep_mode"] = True
        if not merge:
            llm["max_lora_rank"] = max_lora_rank
        if device == "cpu":
            from glm5_mcore.cpu_compat import vllm_cpu_env, vllm_cpu_llm_kwargs

            llm.update(vllm_cpu_llm_kwargs())
            env.update(vllm_cpu_env())
        else:
            llm["gpu_memory_utilization"] = gpu_memory_utilization
        if mtp_draft_tokens:  # speculative decoding with the checkpoint's MTP layer as the draft
            llm["speculative_config"] = mtp_speculative_config(config, mtp_draft_tokens, hf_dir)
            if device == "cpu":
                from glm5_mcore.cpu_compat import vllm_cpu_speculative_kwargs

                llm["speculative_config"].update(vllm_cpu_speculative_kwargs())
            llm["disable_log_stats"] = False  # vLLM's spec-decode counters (``spec_decode_counts``)
        llm.update(kwargs)
        if vllm_python:
            self.server = RemoteServer(vllm_python, (llm,), {"dense_mla": dense_mla}, env)
        else:
            for k, v in env.items():
                os.environ.setdefault(k, v)
            from rl.rollout.vllm_server import Server

            self.server = LocalServer(Server(llm, dense_mla=dense_mla))
        if push_dir is not None:  # an engine across nodes: its workers on every node read the merged files here
            Path(push_dir).mkdir(parents=True, exist_ok=True)
        self._dir = tempfile.mkdtemp(prefix="glm5_vllm_", dir=push_dir)  # adapters and merged files, its own

    # ------------------------------------------------------------------ colocation (rl.schedule.colocate)
    def sleep(self, level: int) -> str:
        """vLLM's ``LLM.sleep(level)``: 1 = weights to host memory, KV cache dropped; 2 = both dropped, so
        the next ``load_adapter`` pushes every weight (base or merged) back. A logged no-op on vLLM-CPU."""

        check_sleep_level(level)
        if level == 2:
            self._discarded = True
        if not self.sleep_mode:
            from glm5_mcore.cpu_compat import VLLM_CPU_NO_SLEEP

            return f"VLLMRolloutEngine.sleep(level={level}): no-op ({VLLM_CPU_NO_SLEEP})"
        self.server.call("sleep", level)
        return f"VLLMRolloutEngine.sleep(level={level})"

    def wake_up(self, tags: tuple = ("weights", "kv_cache")) -> str:

        check_wake_tags(tags)
        if not self.sleep_mode:
            return f"VLLMRolloutEngine.wake_up(tags={list(tags)}): no-op (vLLM-CPU has no sleep mode)"
        self.server.call("wake_up", list(tags))
        return f"VLLMRolloutEngine.wake_up(tags={list(tags)})"

    def last_push(self) -> dict:
        """{"transport", "buckets": [[HF names] per bucket], "bytes"} of the last push (handles transport)."""
        if self.transport != "handles" or not self.sync_log:
            return {"transport": self.transport}
        return {"transport": self.transport, **self.sync_log[-1]}

    def _all_weights(self) -> tuple:
        """Every HF tensor the served model loads (after a level-2 sleep all of them come back)."""
        from glm5_mcore.checkpoint.hf_io import HFCheckpoint

        out = []
        for h in HFCheckpoint(self.hf_dir).keys():
            if h.endswith("_scale_inv") or (not self.drafts and is_mtp_tensor(h, self.num_hidden_layers)):
                continue
            fused = re.match(r"^(model\.layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$", h)
            if fused:  # transformers' fused expert tensors: the per-expert names vLLM's loader takes
                kinds = ("down_proj",) if fused.group(2) == "down_proj" else ("gate_proj", "up_proj")
                out += [f"{fused.group(1)}.{e}.{k}.weight" for e in range(self.n_experts) for k in kinds]
            else:
                out.append(h)
        return tuple(out)

    # ------------------------------------------------------------------ weights
    def load_adapter(self, payload: Optional[AdapterPayload]) -> None:
        """Install ``payload``; while stream requests are live it waits for them (``stream_poll`` installs
        it): a push reloads weights in place, under their KV cache."""
        if self.stream.live:
            self._deferred, self.stream.hold = (payload,), True
            return
        self._deferred = None
        self._load(payload)

    def _install_deferred(self) -> None:
        if self._deferred is not None and not self.stream.live:
            (payload,), self._deferred = self._deferred, None
            self._load(payload)
            self.stream.hold = False

    def _load(self, payload: Optional[AdapterPayload]) -> None:
        self.payload_version = payload.version if payload is not None else -1
        if self._discarded:  # level-2 sleep: the base of every tensor first, then this push as usual
            self._discarded = False
            self._pushed = set(self._all_weights())
            if not self.merge:  # a LoRARequest serves on the base: reload it (merged: the push below does)
                self._push({})
        if payload is None or not payload.files:
            self.lora = None
            if self._pushed:
                self._push({})
            return
        path = Path(self._dir) / f"v{payload.version}"
        path.mkdir(parents=True, exist_ok=True)
        for name, data in payload.files.items():
            (path / name).write_bytes(data)
        if self.merge:
            part = "all" if self.drafts else "decoder"
            self._push(iter_merged_weights(self.hf_dir, path, tuple(self._pushed), self.push_bytes, part))
            shutil.rmtree(path, ignore_errors=True)
            return
        with safe_open(str(path / "adapter_model.safetensors"), "pt") as f:
            routed = sorted({k.split(".experts.")[0] for k in f.keys() if ROUTED_ADAPTER.search(k)})
        if routed:
            shutil.rmtree(path, ignore_errors=True)
            raise ValueError("VLLMRolloutEngine: " + LORA_MODE_EXPERTS.format(what=f"{len(routed)} layers"))
        # merged even in LoRA mode: the MTP layer (vLLM's LoRA does not reach the draft model) and the MLA
        # up-projection (vLLM's MLA never applies its LoRA); restores whatever an earlier push changed
        L = self.num_hidden_layers
        self._push(iter_merged_weights(self.hf_dir, path, tuple(self._pushed), self.push_bytes, "all",
                                       merged=lambda h: self.drafts if is_mtp_tensor(h, L) else is_mla_up_kv(h)))

        for name, data in adapter_without_mtp(payload.files, L, drop_modules=(MLA_UP_KV,)).items():
            (path / name).write_bytes(data)
        self.lora = (f"policy_v{payload.version}", payload.version + 1, str(path))

    def _push(self, chunks) -> None:
        """Reload each dict of ``chunks`` (HF names → tensors) in vLLM, one safetensors file at a time:
        the decoder's tensors in the served model, the MTP layer's in the draft model; ``{}``: every
        tensor pushed before goes back to base. Remembers what now differs from base."""
        from safetensors.torch import save_file

        threads = torch.get_num_threads()
        torch.set_num_threads(self.push_threads)
        try:
            self._push_chunks(chunks, save_file)
        finally:
            torch.set_num_threads(threads)

    def _push_chunks(self, chunks, save_file) -> None:
        if chunks == {}:  # base model again: every pushed tensor from the base shards
            chunks = iter_merged_weights(self.hf_dir, None, tuple(self._pushed), self.push_bytes, "all")
        pushed = set()
        file = Path(self._dir) / "merged.safetensors"
        buckets: list = []
        for weights in chunks:
            draft = {h: w for h, w in weights.items() if is_mtp_tensor(h, self.num_hidden_layers)}
            for method, part in (("reload", {h: w for h, w in weights.items() if h not in draft}),
                                 ("reload_draft", draft)):
                if not part:
                    continue
                if self.transport == "handles":
                    buckets += self._send_buckets(method, part)
                    continue
                save_file(part, str(file))
                try:
                    self.server.call(method, str(file))
                finally:
                    file.unlink(missing_ok=True)
            names = {h for h in weights if not h.endswith("_scale_inv")}
            pushed |= names
            self._pushed |= names  # a failure mid-way still restores these with the next push
        self._pushed = pushed
        if self.transport == "handles":  # as ``Server.reload`` does per file: no KV of the old weights served
            self.server.call("reset_prefix_cache")
            self.sync_log.append({"buckets": [b["names"] for b in buckets], "bytes": sum(b["bytes"] for b in buckets)})

    def _send_buckets(self, method: str, part: dict) -> list[dict]:
        """``part`` to vLLM as ``rl.rollout.weight_sync`` buckets of whole decoder layers (at most ``push_bytes``
        unless one layer is larger: the granularity the file path reloads), each handed over as a CUDA IPC handle on GPUs (the bucket built on the engine's GPU) or
        the shared-file stand-in on the CPU."""

        cuda = torch.cuda.is_available() and self.device != "cpu"
        codec = weight_sync.codec("cuda_ipc" if cuda else "shared_file")

        def group_of(h: str) -> str:  # whole decoder layers, as the file path's chunks (iter_merged_weights):
            m = HF_LAYER.match(h)         # vLLM's MoE gate (weight + e_score_correction_bias) and MLA modules
            return f"model.layers.{m.group(1)}" if m else h  # rebuild from what one reload brings

        return weight_sync.send([part], self.push_bytes, codec,
                                lambda handle, metas: self.server.call(method + "_handle", handle, metas, codec.name),
                                group_of, torch.device("cuda", torch.cuda.current_device()) if cuda else None)

    def generate(self, requests: list[Request], params: SamplingParams, batched: bool = True) -> list[Result]:
        """A request with ``prefix_ids`` (partial rollouts) goes to vLLM as prompt + prefix with
        ``max_new_tokens - len(prefix_ids)`` tokens left and the seed ``request_seed(seed, len(prefix_ids))``;
        its ``Result`` is the prefix (with ``prefix_logprobs``) then what vLLM sampled. ``interrupt`` from
        another thread ends the call at vLLM's next step: unfinished responses come back ``"interrupted"``."""
        sps = vllm_sampling(requests, params, self.drafts and self.device == "cpu")
        t0 = time.perf_counter()
        with self._call_lock:
            self._calls += 1
            self._running, stop_after, self._stop_after = self._calls, self._stop_after, None
        try:
            outs = self.server.call("generate", [list(r.prompt_ids) + list(r.prefix_ids) for r in requests], sps,
                                    self.lora, call=self._running, stop_after=stop_after)
        finally:
            with self._call_lock:
                self._running = None
        self.occupancy.add(min(len(requests), self.occupancy.slots), time.perf_counter() - t0)  # finished rows too
        return [to_result(r, ids, lps, reason, routes[0] if routes else None, self.route_dtype)
                for r, (ids, lps, reason, *routes) in zip(requests, outs)]

    def take_occupancy(self) -> dict:
        """Requests in vLLM (at most ``max_num_seqs``) / ``max_num_seqs``, time-averaged since the last call: a
        stream poll counts the requests live when it started (it returns when one finishes), a ``generate``
        its whole batch for the call (an upper bound: finished rows count until the call ends)."""
        return self.occupancy.take()

    # ------------------------------------------------------------------ the stream (continuous generation)
    def stream_submit(self, requests: list[Request], params: SamplingParams) -> None:
        """Queue ``requests`` (checked as ``generate`` checks them); the next ``stream_poll`` adds them."""
        self.stream.submit(list(zip(requests, vllm_sampling(requests, params, self.drafts and self.device == "cpu"))))

    def stream_poll(self, timeout_s: float = 0.25) -> list[Result]:
        """vLLM steps until a response finishes or ``timeout_s`` passes (``rl.rollout.vllm_stream``), each
        ``Result.version`` the adapter its new tokens were sampled under; after an interrupt every live and
        queued request, ``"interrupted"``. A push waiting for the live requests is installed once they are done."""
        self._install_deferred()
        if not self.stream.has_work():
            time.sleep(min(timeout_s, 0.05))
            return []

        def step(adds, timeout, abort):
            with self._call_lock:
                self._calls += 1
                self._running = self._calls
            t0, live = time.perf_counter(), min(len(self.stream.live), self.occupancy.slots)
            try:
                return self.server.call("stream_step", adds, timeout, abort=abort, call=self._running)
            finally:
                self.occupancy.add(live, time.perf_counter() - t0)
                with self._call_lock:
                    self._running = None

        out = self.stream.poll(step, self.lora, self.payload_version, timeout_s, self.route_dtype)
        self._install_deferred()
        return out

    def interrupt(self) -> bool:
        """The running ``generate`` or stream poll (if any) ends at vLLM's next step
        (``vllm_server.Server.interrupt``; in a child process through its reading thread, so it arrives while
        the call waits); the stream's interrupt is sticky until its next poll."""
        self.stream.interrupt()
        with self._call_lock:
            if self._running is not None:
                self.server.notify("interrupt", self._running)
        return True

    def interrupt_after(self, steps: int) -> None:
        """The next ``generate`` is interrupted after ``steps`` vLLM engine steps (one token per running
        request each, without speculative decoding): an interruption at a chosen token, for tests."""
        self._stop_after = int(steps)

    def spec_decode_counts(self) -> dict:
        """vLLM's cumulative speculative-decoding counters: {"draft_tokens": n, "accepted_tokens": m}
        (the draft head's acceptance is m / n); {} when not drafting."""
        return self.server.call("spec_decode_counts") if self.drafts else {}

    def draft_weights(self, names: Optional[list] = None) -> dict:
        """The draft model's parameters as vLLM holds them (vLLM names → numpy arrays; ``names``: only
        those): to check that a push reached the draft head."""
        return self.server.call("draft_weights", names)

    def close(self) -> None:
        self.server.close()
        shutil.rmtree(self._dir, ignore_errors=True)

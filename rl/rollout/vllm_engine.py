"""vLLM rollout engine (vLLM 0.32, the GPU extra; vLLM's CPU build in tests): token ids in, ids +
log-probs out.

vLLM itself runs in ``rl.rollout.vllm_server``: in this process, or, with ``vllm_python``, in a child
process under that interpreter (an environment of its own: vLLM pins torch / transformers versions
the trainer's need not share; ``setup_vllm_cpu.sh`` makes ``.venv-vllm`` so for the CPU tests).

The adapter arrives as the same HF PEFT payload the embedded engine loads. In LoRA mode (the default,
``rl.rollout.vllm_lora``) every family vLLM has a LoRA layer for — MLA, the dense and shared MLPs, the routed
experts, the indexer's ``wq_b`` — is served as a ``LoRARequest`` built in the engine's workers from the pushed
tensors (``rl.rollout.vllm_adapters``, no adapter file), one vLLM LoRA id per version
(``rl.rollout.vllm_push.AdapterVersions``): a request runs under the version it was admitted with, so a push
neither waits for the live requests nor changes what they sample, and a version leaves vLLM once no request uses
it (``max_loras`` versions share a batch). The families vLLM cannot serve as LoRA (``kv_b_proj``, the indexer's
``wk`` / ``weights_proj``, the MTP layer) are merged into the served weights as merged mode does; a push that
changes the decoder's weights (a merged family) waits for the live stream requests, as every merged push does.

``merge=True`` folds the whole adapter into the base weights on the host instead, pushing only the modules a
non-zero adapter touches — ``rl.rollout.vllm_weights.iter_merged_weights``: W + scale·B·A per adapted HF tensor,
from the base shards (never cumulative, so a second push replaces the first), in the dtype the served folder
stores, FP8 block-quantized (``glm5_mcore.checkpoint.fp8``) where it stores FP8 — reloaded in place by vLLM's
workers (``rl.rollout.vllm_push.ServedWeights``). Every merged push reports the fraction of the adapter's delta
the served weights keep per family (``last_push()["merged_delta_kept"]``) and refuses an FP8 one that keeps
under 90 %: a small adapter re-quantized to e4m3 is mostly rounded away.

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
import shutil
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Optional

from safetensors.torch import load

from glm5_mcore.lora.peft import peft_state
from rl.rollout.base import (AdapterPayload, Occupancy, Request, Result, RolloutEngine, SamplingParams,
                             check_sleep_level, check_wake_tags)
from rl.rollout.draft import mtp_speculative_config
from rl.rollout.routes import route_dtype
from rl.rollout.vllm_client import LocalServer, RemoteServer
from rl.rollout.vllm_lora import (VLLM_MODULES, check_lora_mode, cpu_loras, lora_job_kwargs, lora_mode_part,
                                  served_adapter)
from rl.rollout.vllm_push import AdapterVersions, ServedWeights
from rl.rollout.vllm_stream import EngineStream, to_result, vllm_sampling
from rl.rollout.vllm_weights import (KEPT_MIN, adapted_tensors, default_push_threads, iter_merged_weights,
                                     merged_delta_kept, vllm_module_tensors)


def check_lora_targets(kwargs: dict, lora) -> None:
    """``rollout.engine_kwargs`` with the policy's ``lora`` section (``rank``, ``targets``), before Ray:
    vLLM's limits on LoRA mode (``rl.rollout.vllm_lora.check_lora_mode``)."""
    check_lora_mode(kwargs, int(lora.rank), lora.targets)


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

    LoRA mode (``merge=False``): ``max_lora_rank``, ``max_loras`` (adapter versions in one batch; the RL pool
    sets ``trainer.max_staleness + 1``), ``server_imports`` (modules the vLLM process imports first: plugins; the
    CPU tests' MoE-LoRA kernel shim). ``merged_delta_kept_min`` (default 0.9): the refusal of a merged FP8 push.
    Every reload drops vLLM's prefix cache (``vllm_server.Server.reload``).

    The draft head follows the trained one: vLLM builds the MTP layer as a separate draft model that
    neither ``reload_weights`` (the decoder's loader skips ``model.layers.{num_hidden_layers}.*``) nor a
    ``LoRARequest`` (vLLM applies LoRA to the decoder only) reaches. So, while drafting, every push
    also merges the payload's MTP-layer adapter (``W + scale·B·A``, whole vLLM modules, as for the
    decoder) and reloads it into the draft model (``vllm_server.Server.reload_draft``) — in merged and
    LoRA mode alike; the LoRARequest carries the decoder's adapter only."""

    FORWARDS_KWARGS = True  # the rest go to vllm.LLM, whose EngineArgs refuses unknown keys
    check_lora_targets = staticmethod(check_lora_targets)  # run by rl.validate with the lora section
    job_kwargs = staticmethod(lora_job_kwargs)  # rl.cluster.rollout_pool: LoRA targets and versions of the job
    SPANS_BUNDLES = True  # distributed_executor_backend="ray" over the bundles rl.cluster.engine_placement names
    INTERRUPTIBLE = True
    STREAMS = True  # rl.rollout.vllm_stream: vLLM's scheduler loop kept running across calls

    def __init__(self, hf_dir: str, deterministic_topk: bool = True, merge: bool = False, max_lora_rank: int = 64,
                 dtype: str = "bfloat16", gpu_memory_utilization: float = 0.8, tensor_parallel_size: int = 1,
                 vllm_python: Optional[str] = None, dense_mla: bool = False, device: Optional[str] = None,
                 push_bytes: int = 2 << 30, return_routes: bool = False, mtp_draft_tokens: int = 0,
                 push_threads: Optional[int] = None, sleep_mode: bool = False, weight_transport: str = "file",
                 push_dir: Optional[str] = None, stream: bool = True, server_imports: tuple = (),
                 merged_delta_kept_min: float = KEPT_MIN, **kwargs):
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
        self.merge, self.dense_mla, self.kept_min = merge, dense_mla, float(merged_delta_kept_min)
        self.route_dtype = route_dtype(int(config.get("n_routed_experts") or config.get("num_local_experts") or 256))
        self.num_hidden_layers = int(config["num_hidden_layers"])
        self.drafts = bool(mtp_draft_tokens)
        self.device = device
        self.lora: Optional[tuple] = None  # the newest adapter version's LoRARequest tuple (LoRA mode)
        self.sleep_mode = sleep_mode and device != "cpu"  # cpu_compat.VLLM_CPU_NO_SLEEP
        self._call_lock = threading.Lock()  # generate's call number vs interrupt (another thread)
        self._calls, self._running, self._stop_after = 0, None, None
        self._discarded = False  # a level-2 sleep: the next push brings every weight back
        self.stream = EngineStream()
        self.occupancy = Occupancy(int(kwargs.get("max_num_seqs") or 256))  # vLLM's default max_num_seqs
        self.payload_version = -1  # the AdapterPayload.version loaded (what a stream Result.version reports)
        self._deferred: Optional[tuple] = None  # (payload, parsed): a push waiting for the live stream requests
        self.pushes: list[dict] = []  # per push: what travelled and how long it took (``last_push``)
        env: dict = {}
        llm = dict(model=str(hf_dir), dtype=dtype, enable_lora=not merge, tensor_parallel_size=tensor_parallel_size,
                   logprobs_mode="processed_logprobs", enable_prefix_caching=False)
        if return_routes:
            llm.update(enable_return_routed_experts=True, enable_prefix_caching=True)
        if self.sleep_mode:  # colocated with the trainer (rl.schedule.colocate)
            llm["enable_sleep_mode"] = True
        if not merge:  # routed experts come in PEFT's fused 3D form; LoRA layers only where LoRA is served
            llm.update(max_lora_rank=max_lora_rank, enable_mixed_moe_lora_format=True,
                       lora_target_modules=sorted(set(VLLM_MODULES.values())), max_cpu_loras=cpu_loras(kwargs))
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
        server_kwargs = {"dense_mla": dense_mla, "imports": tuple(server_imports)}
        if vllm_python:
            self.server = RemoteServer(vllm_python, (llm,), server_kwargs, env)
        else:
            for k, v in env.items():
                os.environ.setdefault(k, v)
            from rl.rollout.vllm_server import Server

            self.server = LocalServer(Server(llm, **server_kwargs))
        if push_dir is not None:  # an engine across nodes: its workers on every node read the merged files here
            Path(push_dir).mkdir(parents=True, exist_ok=True)
        self._dir = tempfile.mkdtemp(prefix="glm5_vllm_", dir=push_dir)  # merged files, its own
        self.weights = ServedWeights(self.server, hf_dir, self.num_hidden_layers,
                                     int(config.get("n_routed_experts") or 1), self.drafts, weight_transport,
                                     push_bytes, int(push_threads or default_push_threads()), self._dir, device)
        self.adapters = AdapterVersions(self.server)

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
        """The last push: {"transport", "mode" ("lora" / "merged"), "lora_bytes" (the LoRARequest's tensors),
        "merged_bytes" (merged tensors reloaded), "seconds", "merged_delta_kept" ({family: fraction}), "waited"
        (whether it waited for live stream requests); with the handles transport, "buckets" and "bytes"}."""
        return {"transport": self.weights.transport, **(self.pushes[-1] if self.pushes else {})}

    # ------------------------------------------------------------------ weights
    def load_adapter(self, payload: Optional[AdapterPayload]) -> None:
        """Install ``payload``. A push that changes the served weights (merged mode, a merged family in LoRA
        mode, the base restored) waits while stream requests are live (``stream_poll`` installs it): it reloads
        weights in place, under their KV cache. A LoRA-mode push of served families only is installed at once:
        the live requests keep their version."""
        parsed = self._parse(payload)
        if self.stream.live and self._changes_weights(parsed[1]):
            self._deferred, self.stream.hold = (payload, parsed), True
            return
        self._deferred = None
        self._load(payload, parsed, waited=False)

    def _parse(self, payload: Optional[AdapterPayload]) -> tuple:
        """(the payload's tensors, its adapter as an ``AdapterState``), in memory; (None, None) for the base model.
        In LoRA mode the state holds only the tensors a push merges (the served ones travel as they are:
        ``served_adapter``), so the routed experts' adapter is never unpacked here."""
        if payload is None or not payload.files:
            return None, None
        tensors = load(payload.files["adapter_model.safetensors"])
        merged = tensors if self.merge else {k: v for k, v in tensors.items()
                                             if lora_mode_part(k, self.num_hidden_layers, self.dense_mla) != "lora"}
        return tensors, peft_state(json.loads(payload.files["adapter_config.json"]), merged, self.num_hidden_layers)

    def _merged(self, hf_name: str) -> bool:
        """Whether a push merges ``hf_name`` into the served weights (rather than a LoRARequest serving it)."""
        part = lora_mode_part(hf_name, self.num_hidden_layers, self.dense_mla)
        if part == "draft":
            return self.drafts
        return part != "dropped" and (self.merge or part == "merged")

    def _changes_weights(self, state) -> bool:
        """Whether installing ``state`` reloads a decoder weight in place."""
        if self.merge or self._discarded or self.weights.decoder_pushed():
            return True
        merged = adapted_tensors(state, self.num_hidden_layers, self._merged) if state is not None else {}
        return any(lora_mode_part(h, self.num_hidden_layers) != "draft" for h in merged)

    def _install_deferred(self) -> None:
        if self._deferred is not None and not self.stream.live:
            (payload, parsed), self._deferred = self._deferred, None
            self._load(payload, parsed, waited=True)
            self.stream.hold = False

    def _load(self, payload: Optional[AdapterPayload], parsed: tuple, waited: bool) -> None:
        tensors, state = parsed
        self.payload_version = payload.version if state is not None else -1
        entry = {"mode": "merged" if self.merge else "lora", "waited": waited, "lora_bytes": 0, "merged_bytes": 0}
        t0 = time.perf_counter()
        if self._discarded:  # level-2 sleep: the base of every tensor first, then this push as usual
            self._discarded = False
            self.weights.pushed = set(self.weights.all_weights())
        kept: dict = {}
        merged = adapted_tensors(state, self.num_hidden_layers, self._merged) if state is not None else {}
        if merged or self.weights.pushed:  # restores whatever an earlier push changed
            part = "all" if self.drafts else "decoder"
            chunks = iter_merged_weights(self.hf_dir, state, tuple(self.weights.pushed), self.weights.push_bytes,
                                         part, merged=self._merged, kept=kept, kept_min=self.kept_min)
            changed = {n for h in merged for n in vllm_module_tensors(h, self.weights.n_experts)}
            entry.update({k: v for k, v in self.weights.push(chunks, changed).items() if k != "seconds"})
        self.lora = None
        if state is not None and not self.merge:
            served = served_adapter(payload.files, self.num_hidden_layers, self.dense_mla, tensors)
            if served is not None:
                self.lora = self.adapters.add(payload.version, served)
                entry["lora_bytes"] = served.nbytes
        self._retire()
        entry.update(seconds=time.perf_counter() - t0, merged_delta_kept=merged_delta_kept(kept))
        self.pushes.append(entry)

    def _retire(self) -> None:
        """LoRA versions neither the newest nor used by a live stream request leave vLLM."""
        with self.stream.lock:
            keep = {v for _, v in self.stream.live.values()}
        self.adapters.retire(keep | ({self.payload_version} if self.lora is not None else set()))

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
        if out and self.adapters.by_version:
            self._retire()
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

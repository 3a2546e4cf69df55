"""The vLLM side of ``VLLMRolloutEngine``: with ``rl.rollout.vllm_stream``, the only modules that import vLLM (0.32).

It runs where vLLM is installed (``rl.rollout.vllm_stream`` holds its continuous-generation half,
``rl.rollout.vllm_reload`` what runs on the workers for a weight push, ``rl.rollout.vllm_adapters`` the
in-memory LoRA adapters): in the engine's own process when the rollout environment has vLLM,
or as ``python -m rl.rollout.vllm_server`` under another interpreter (``vllm_python``: vLLM pins
torch / transformers versions the trainer's environment need not share), answering the engine over
a ``multiprocessing.connection`` socket. It imports nothing of the project but this file,
those modules and ``rl.rollout.weight_sync`` (torch only), and what crosses the socket is plain data (token ids,
floats, file paths, bucket handles, an adapter's safetensors bytes): merged weights travel as safetensors files, or
(colocated engines) as weight-sync buckets; a LoRA adapter as bytes in memory (``add_adapter``).

- ``generate``: ``TokensPrompt`` in, token ids + ``processed_logprobs`` out (token-in/token-out, no
  detokenisation); an adapter as a ``LoRARequest`` of an adapter ``add_adapter`` holds on the workers. ``interrupt`` (partial rollouts) ends it at a step
  boundary: the unfinished requests are aborted and return what they sampled so far.
- ``reload_draft``: the MTP layer's tensors into the speculative draft model (which ``reload`` never
  reaches), ``draft_weights`` reads them back, ``spec_decode_counts`` gives the draft's acceptance.
- ``reload_handle`` / ``reload_draft_handle``: one ``rl.rollout.weight_sync`` bucket (CUDA IPC handle, or its CPU
  stand-in) rebuilt as views on each worker and reloaded like ``reload``'s file.
- ``reload``: vLLM 0.32's worker has no ``load_weights``, only ``reload_weights(weights_iterator=...,
  is_checkpoint_format=True)``, and tensors sent through ``collective_rpc`` arrive as nested lists;
  so the engine writes the merged tensors to a safetensors file and a function run on every worker
  reloads from it (sending a function needs ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``, set here).
- ``dense_mla``: vLLM-CPU has no sparse attention (``vllm/platforms/cpu.py``: "Sparse Attention is not
  supported on CPU"); the ``glm_moe_dsa`` config is rewritten as DeepSeek-V3's (dense MLA, no
  ``index_*``; the loader skips the indexer weights). The same function as GLM-5 only while DSA
  selects every key (``index_topk`` >= every sequence length): the engine checks that.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Optional

from rl.rollout import vllm_adapters, vllm_reload
from rl.rollout.vllm_stream import ServerStream, absorb, add_requests

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def dense_mla_config(cfg):
    """``hf_overrides``: a ``glm_moe_dsa`` config as a ``DeepseekV3Config`` without the DSA indexer.

    With MTP speculative decoding vLLM builds the draft model's config with its own override first
    (``SpeculativeConfig.hf_config_override``: ``model_type`` "deepseek_mtp", the sparse
    ``DeepseekV32MTPModel``), then this one (``compose_draft_hf_overrides``): the draft stays an MTP
    model, DeepSeek-V3's dense one, loaded by ``GLM5DenseMLAMTPModel`` (registered by ``Server`` in its own
    process: the engine core must run there, as ``cpu_compat.vllm_cpu_env`` has it)."""
    from transformers import DeepseekV3Config

    drop = ("mlp_layer_types", "model_type", "transformers_version", "indexer_types")
    d = {k: v for k, v in cfg.to_dict().items() if not k.startswith("index") and k not in drop}
    draft = getattr(cfg, "model_type", None) == "deepseek_mtp"
    # the draft: our loader first; "DeepSeekMTPModel" too, the name vLLM's proposer checks for the
    # (logits hidden, recycled hidden) pair the MTP forward returns (llm_base_proposer.py:1002)
    d["architectures"] = [DENSE_MLA_MTP, "DeepSeekMTPModel"] if draft else ["DeepseekV3ForCausalLM"]
    out = DeepseekV3Config(**d)
    if draft:
        out.model_type = "deepseek_mtp"
    return out


DENSE_MLA_MTP = "GLM5DenseMLAMTPModel"


def _dense_mla_mtp_class():
    """vLLM's ``DeepSeekMTP`` loading the MTP layer of a ``glm_moe_dsa`` folder served as dense MLA: its
    ``load_weights`` has no indexer skip (deepseek_mtp.py:507 raises KeyError on
    ``mtp_block.self_attn.indexer.*``, where the decoder's loader, deepseek_v2.py:1657, drops the
    indexer weights of a layer built without one), so the indexer tensors are dropped before it."""
    from vllm.model_executor.models.deepseek_mtp import DeepSeekMTP

    class GLM5DenseMLAMTPModel(DeepSeekMTP):
        def load_weights(self, weights):
            return super().load_weights((n, w) for n, w in weights if ".indexer." not in n)

    return GLM5DenseMLAMTPModel


class Server:
    """One ``vllm.LLM`` and the three things the engine asks of it."""

    def __init__(self, llm_kwargs: dict, dense_mla: bool = False, imports: tuple = ()):
        """``imports``: modules imported before the engine is built (vLLM plugins: a registered model, kernels)."""
        import importlib

        for name in imports:
            importlib.import_module(name)
        from vllm import LLM

        kw = dict(llm_kwargs)
        if dense_mla:
            kw["hf_overrides"] = dense_mla_config
            if kw.get("speculative_config"):
                from vllm import ModelRegistry

                ModelRegistry.register_model(DENSE_MLA_MTP, _dense_mla_mtp_class())
        self.llm = LLM(**kw)
        self.calls = 0  # generate calls so far (request ids; vLLM's own counter is LLM's)
        self.interrupted: Optional[int] = None  # the engine's call number ``interrupt`` names
        self.stream: Optional[ServerStream] = None

    def generate(self, prompts: list[list[int]], params: list[dict], lora: Optional[tuple] = None,
                 call: Optional[int] = None, stop_after: Optional[int] = None) -> list:
        """[(token ids, log-probs of those tokens, finish reason, routed experts or None)] per prompt; ``params`` are
        ``vllm.SamplingParams`` keyword dicts, ``lora`` = (name, int id, 3D experts) or None.

        vLLM's own loop (``LLM._run_engine``, entrypoints/common/offline.py:589: ``LLMEngine.step`` while
        requests are unfinished), with DELTA outputs so the tokens and log-probs sampled so far are known
        after every step. ``interrupt(call)`` from another thread ends it at the next step boundary: the
        unfinished requests are aborted (``LLMEngine.abort_request``, v1/engine/llm_engine.py:224) and
        come back with what they sampled, finish reason ``"interrupted"``. (The offline ``LLM`` has no
        ``pause_generation``: that is ``AsyncLLM``'s, v1/engine/async_llm.py:952, whose ``mode="keep"``
        would continue on the old weights' KV cache; an abort and a re-prefill under the new weights is what
        the trainer's per-token log-probs of a continued response are.) ``stop_after``: interrupted after
        that many engine steps that sampled (one token per running request each, without speculative
        decoding): a deterministic interruption point."""
        if self.stream is not None and self.stream.acc:
            raise RuntimeError(f"generate while {len(self.stream.acc)} stream requests are live (abort them first)")
        self.calls += 1
        ids = [f"glm5-{self.calls}-{i}" for i in range(len(prompts))]
        acc = {rid: [[], [], None, None] for rid in ids}
        live: set = set(ids)
        steps = 0
        try:
            add_requests(self.llm, ids, prompts, params, lora)
            while live and self.llm.llm_engine.has_unfinished_requests():
                if (call is not None and self.interrupted == call) or (stop_after is not None and steps >= stop_after):
                    break
                before = sum(len(a[0]) for a in acc.values())
                live.difference_update(absorb(acc, self.llm.llm_engine.step()))
                steps += sum(len(a[0]) for a in acc.values()) > before
        finally:
            if live:  # interrupted (or failed): nothing of this call stays in the engine
                self.llm.llm_engine.abort_request(sorted(live))
        return [(toks, lps, reason or "interrupted", routes) for toks, lps, reason, routes in (acc[r] for r in ids)]

    def stream_step(self, adds: list, timeout_s: float, abort: bool = False, call: Optional[int] = None) -> list:
        """Continuous generation (``rl.rollout.vllm_stream``): add ``adds`` [(rid, prompt ids, params, lora)] to
        the running stream, then engine steps until a request finishes or ``timeout_s`` passes; ``abort`` or
        ``interrupt(call)`` hands every live request back ``"interrupted"``. [(rid, ids, lps, reason, routes)]."""
        if self.stream is None:
            self.stream = ServerStream(self.llm)
        if abort:
            return self.stream.abort()
        self.stream.add(adds)
        return self.stream.step(timeout_s, lambda: call is not None and self.interrupted == call)

    def interrupt(self, call: int) -> None:
        """End ``generate`` number ``call`` at its next step boundary (a no-op once it has returned: an
        interrupt that arrives late never reaches a later call)."""
        self.interrupted = call

    def reload(self, path: str) -> int:
        """Reload the tensors of the safetensors file ``path`` (HF names) on every worker, then drop the
        prefix cache: an in-place reload resets only the LoRA / encoder caches (``gpu/model_runner.py:568``)
        and block hashes change only for LoRA requests, so cached KV (and R3 routes) of the old weights
        would be served for any prompt seen before."""
        n = sum(self.llm.collective_rpc(vllm_reload.reload_from_file, kwargs={"path": path}))
        self.reset_prefix_cache()
        return n

    def add_adapter(self, name: str, lora_id: int, config: dict, data: bytes, is_3d: bool) -> list[str]:
        """The PEFT adapter ``data`` (safetensors bytes, in memory) held by every worker as LoRA ``lora_id``
        (``rl.rollout.vllm_adapters``) and loaded now; the vLLM modules it adapts."""
        from safetensors.torch import load

        tensors = load(data)
        return self.llm.collective_rpc(vllm_adapters.add, kwargs={"name": name, "lora_id": lora_id, "config": config,
                                                                  "tensors": tensors, "is_3d": is_3d})[0]

    def remove_adapter(self, lora_id: int) -> None:
        """LoRA ``lora_id`` out of every worker (no request may use it any more)."""
        self.llm.collective_rpc(vllm_adapters.remove, kwargs={"lora_id": lora_id})

    def reload_handle(self, handle, metas: list, codec: str) -> int:
        """Reload one weight-sync bucket (``rl.rollout.weight_sync``) on every worker; the engine drops the prefix
        cache once the last bucket of a push is in (``reset_prefix_cache``)."""
        return sum(self.llm.collective_rpc(vllm_reload.reload_from_handle, kwargs={"handle": handle, "metas": metas,
                                                                        "codec": codec}))

    def reload_draft_handle(self, handle, metas: list, codec: str) -> int:
        return sum(self.llm.collective_rpc(vllm_reload.reload_from_handle, kwargs={"handle": handle, "metas": metas,
                                                                        "codec": codec, "draft": True}))

    def reload_draft(self, path: str) -> int:
        """Reload the MTP-layer tensors of the safetensors file ``path`` (HF names) into the draft model
        (and drop the prefix cache, as ``reload``)."""
        n = sum(self.llm.collective_rpc(vllm_reload.reload_draft_from_file, kwargs={"path": path}))
        self.reset_prefix_cache()
        return n

    def reset_prefix_cache(self) -> None:
        """``LLM.reset_prefix_cache()``; a refusal (requests still hold blocks) is an error, not stale KV."""
        if self.llm.reset_prefix_cache() is False:
            raise RuntimeError("vLLM refused reset_prefix_cache() after a weight reload (blocks still in use)")

    def draft_weights(self, names: Optional[list] = None) -> dict:
        """The draft model's parameters on the first worker (vLLM names → numpy arrays)."""
        return self.llm.collective_rpc(vllm_reload.draft_weights, kwargs={"names": names})[0]

    def spec_decode_counts(self) -> dict:
        """Cumulative speculative-decoding counters: draft tokens proposed and accepted."""
        out = {"draft_tokens": 0, "accepted_tokens": 0}
        for m in self.llm.get_metrics():
            if m.name == "vllm:spec_decode_num_draft_tokens":
                out["draft_tokens"] = int(m.value)
            elif m.name == "vllm:spec_decode_num_accepted_tokens":
                out["accepted_tokens"] = int(m.value)
        return out

    def sleep(self, level: int) -> None:
        """``LLM.sleep(level)`` (the engine started with ``enable_sleep_mode``): colocated runs."""
        self.llm.sleep(level=level)

    def wake_up(self, tags: list) -> None:
        self.llm.wake_up(tags=list(tags))

    def ping(self) -> str:
        import vllm

        return vllm.__version__


def main() -> int:
    """``python -m rl.rollout.vllm_server ADDRESS``: serve ``Server`` calls; the auth key is in
    ``GLM5_VLLM_AUTHKEY`` (hex). Messages: (method, args, kwargs) → ("ok", result) | ("error", text), one
    call at a time, in order; except ``("interrupt", (call,), {})``, which gets no answer and is served by
    the reading thread at once (``Server.interrupt``), so it reaches a ``generate`` that is running."""
    import queue
    import threading
    from multiprocessing.connection import Client

    conn = Client(sys.argv[1], authkey=bytes.fromhex(os.environ.pop("GLM5_VLLM_AUTHKEY")))
    server = None
    calls: queue.Queue = queue.Queue()

    def read() -> None:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                calls.put(None)
                return
            if msg[0] == "interrupt":
                if server is not None:
                    server.interrupt(*msg[1])
                continue
            calls.put(msg)
            if msg[0] == "close":
                return

    threading.Thread(target=read, name="glm5-vllm-server-reader", daemon=True).start()
    while True:
        msg = calls.get()
        if msg is None:
            return 0
        method, args, kwargs = msg
        if method == "close":
            if server is not None:
                server.llm.llm_engine.engine_core.shutdown()  # vLLM's own teardown (its engine-core process, if any)
            conn.send(("ok", None))
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)  # the interpreter's own teardown of vLLM's heap took ~2 s of CPU, with nothing left to keep
        try:
            if method == "init":
                server = Server(*args, **kwargs)
                result = None
            else:
                result = getattr(server, method)(*args, **kwargs)
            conn.send(("ok", result))
        except Exception as e:  # noqa: BLE001 - reported to the engine, which raises it
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"))


if __name__ == "__main__":
    from rl.rollout.vllm_server import main as _main  # functions pickled to the workers by module name

    sys.exit(_main())

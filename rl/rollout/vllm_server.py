"""The vLLM side of ``VLLMRolloutEngine``: the only module that imports vLLM (0.32).

It runs where vLLM is installed: in the engine's own process when the rollout environment has vLLM,
or as ``python -m rl.rollout.vllm_server`` under another interpreter (``vllm_python``: vLLM pins
torch / transformers versions the trainer's environment need not share), answering the engine over
a ``multiprocessing.connection`` socket. It imports nothing of the project but this file, and what
crosses the socket is plain data (token ids, floats, file paths): weights travel as safetensors files.

- ``generate``: ``TokensPrompt`` in, token ids + ``processed_logprobs`` out (token-in/token-out, no
  detokenisation); an adapter as a ``LoRARequest``.
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

import numpy as np

os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")


def dense_mla_config(cfg):
    """``hf_overrides``: a ``glm_moe_dsa`` config as a ``DeepseekV3Config`` without the DSA indexer."""
    from transformers import DeepseekV3Config

    drop = ("mlp_layer_types", "model_type", "transformers_version", "indexer_types")
    d = {k: v for k, v in cfg.to_dict().items() if not k.startswith("index") and k not in drop}
    d["architectures"] = ["DeepseekV3ForCausalLM"]
    return DeepseekV3Config(**d)


def _reload_from_file(worker, path: str) -> int:
    """Run on every vLLM worker: reload the checkpoint-format tensors of one safetensors file."""
    from safetensors.torch import load_file

    tensors = load_file(path)
    worker.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
    return len(tensors)


class Server:
    """One ``vllm.LLM`` and the three things the engine asks of it."""

    def __init__(self, llm_kwargs: dict, dense_mla: bool = False):
        from vllm import LLM

        kw = dict(llm_kwargs)
        if dense_mla:
            kw["hf_overrides"] = dense_mla_config
        self.llm = LLM(**kw)

    def generate(self, prompts: list[list[int]], params: list[dict], lora: Optional[tuple] = None) -> list:
        """[(token ids, log-probs of those tokens, finish reason, routed experts or None)] per prompt; ``params`` are
        ``vllm.SamplingParams`` keyword dicts, ``lora`` = (name, int id, path) or None."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        request = None
        if lora is not None:
            from vllm.lora.request import LoRARequest

            request = LoRARequest(lora_name=lora[0], lora_int_id=lora[1], lora_path=lora[2])
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts],
                                 [SamplingParams(**p) for p in params], lora_request=request, use_tqdm=False)
        results = []
        for o in outs:
            c = o.outputs[0]
            ids = list(c.token_ids)
            routes = getattr(c, "routed_experts", None)  # [tokens, moe_layers, top_k] with enable_return_routed_experts
            results.append((ids, [float(step[t].logprob) for step, t in zip(c.logprobs, ids)],
                            str(c.finish_reason), None if routes is None else np.asarray(routes)))
        return results

    def reload(self, path: str) -> int:
        """Reload the tensors of the safetensors file ``path`` (HF names) on every worker."""
        return sum(self.llm.collective_rpc(_reload_from_file, kwargs={"path": path}))

    def ping(self) -> str:
        import vllm

        return vllm.__version__


def main() -> int:
    """``python -m rl.rollout.vllm_server ADDRESS``: serve ``Server`` calls; the auth key is in
    ``GLM5_VLLM_AUTHKEY`` (hex). Messages: (method, args, kwargs) → ("ok", result) | ("error", text)."""
    from multiprocessing.connection import Client

    conn = Client(sys.argv[1], authkey=bytes.fromhex(os.environ.pop("GLM5_VLLM_AUTHKEY")))
    server = None
    while True:
        try:
            method, args, kwargs = conn.recv()
        except EOFError:
            return 0
        if method == "close":
            conn.send(("ok", None))
            return 0
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

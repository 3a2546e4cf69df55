"""vLLM rollout engine (GPU extra: ``pip install vllm``): token ids in, ids + log-probs out.

The adapter arrives as the same HF PEFT payload the embedded engine loads and is served as a
``LoRARequest`` (a new id per version). Where vLLM's GLM-5 LoRA support falls short (routed-expert
adapters in its fused-MoE path), ``merge=True`` folds the adapter into the base weights on the host
(W + scale·B·A per target, from the HF base shards) and pushes them with vLLM's ``load_weights``.

Log-probs are vLLM's ``processed_logprobs`` (after temperature, the distribution the token was drawn
from): with ``top_p < 1`` vLLM renormalises over the nucleus, so this engine refuses ``top_p < 1``
rather than hand IcePop a different quantity. vLLM picks its own DSA top-k kernel; its tie rule is
not ours, so ``deterministic_topk`` is reported as unsupported (a warning), and IcePop's mismatch
metrics show the effect. Not exercised on CPU: tests marked ``gpu`` run it when a GPU is there.
"""

from __future__ import annotations

import json
import tempfile
import warnings
from pathlib import Path
from typing import Optional

from rl.rollout.base import AdapterPayload, Request, Result, RolloutEngine, SamplingParams


def _pattern(patterns: dict, module: str, default):
    """peft's rank/alpha pattern lookup: the first regex that matches the module name's end."""
    import re

    for pat, v in patterns.items():
        if re.search(rf"(^|\.){pat}$", module):
            return v
    return default


class VLLMRolloutEngine(RolloutEngine):
    def __init__(self, hf_dir: str, deterministic_topk: bool = True, merge: bool = False, max_lora_rank: int = 64,
                 dtype: str = "bfloat16", gpu_memory_utilization: float = 0.8, tensor_parallel_size: int = 1,
                 **kwargs):
        super().__init__(hf_dir, deterministic_topk)
        from vllm import LLM

        if deterministic_topk:
            warnings.warn("vLLM selects DSA top-k with its own kernel; the trainer's tie rule is not enforced")
        self.merge = merge
        self.llm = LLM(model=hf_dir, dtype=dtype, enable_lora=not merge, max_lora_rank=max_lora_rank,
                       gpu_memory_utilization=gpu_memory_utilization, tensor_parallel_size=tensor_parallel_size,
                       logprobs_mode="processed_logprobs", enable_prefix_caching=False, **kwargs)
        self.lora = None
        self._dir = tempfile.mkdtemp(prefix="glm5_vllm_lora_")

    def load_adapter(self, payload: Optional[AdapterPayload]) -> None:
        if payload is None or not payload.files:
            self.lora = None
            return
        path = Path(self._dir) / f"v{payload.version}"
        path.mkdir(parents=True, exist_ok=True)
        for name, data in payload.files.items():
            (path / name).write_bytes(data)
        if self.merge:
            self._push_merged(path)
            return
        from vllm.lora.request import LoRARequest

        self.lora = LoRARequest(f"policy_v{payload.version}", payload.version + 1, str(path))

    def _push_merged(self, adapter: Path) -> None:
        """W' = W + scale·B·A for every adapted HF weight (module targets), streamed to vLLM."""
        import torch
        from safetensors.torch import load_file

        from glm5_mcore.hf_io import HFCheckpoint

        cfg = json.loads((adapter / "adapter_config.json").read_text())
        tensors = load_file(str(adapter / "adapter_model.safetensors"))
        base = HFCheckpoint(self.hf_dir)
        weights = []
        for key in tensors:
            if not key.endswith(".lora_A.weight"):
                continue
            module = key[len("base_model.model."): -len(".lora_A.weight")]
            if module.endswith("experts") or module.endswith("base_layer"):
                raise NotImplementedError(f"{module}: merged push of fused routed-expert adapters is not wired")
            a, b = tensors[key].float(), tensors[key.replace("lora_A", "lora_B")].float()
            rank = _pattern(cfg.get("rank_pattern") or {}, module, cfg["r"])
            alpha = _pattern(cfg.get("alpha_pattern") or {}, module, cfg["lora_alpha"])
            if rank != a.shape[0]:
                raise ValueError(f"{adapter}: {module} has rank {a.shape[0]}, config says {rank}")
            w = base.get(f"{module}.weight").float()
            weights.append((f"{module}.weight", (w + (alpha / rank) * (b @ a)).to(torch.bfloat16)))
        self.llm.collective_rpc("load_weights", kwargs={"weights": weights})

    def generate(self, requests: list[Request], params: SamplingParams, batched: bool = True) -> list[Result]:
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        if params.top_p < 1.0:
            raise ValueError("VLLMRolloutEngine: rollout.top_p < 1 makes vLLM's log-probs nucleus-renormalised; "
                             "IcePop needs log_softmax(logits / T) over the full vocabulary")
        sps = [VSP(temperature=params.temperature, top_p=1.0, max_tokens=params.max_new_tokens,
                   stop_token_ids=list(params.stop_token_ids), seed=r.seed % (2 ** 31), logprobs=0,
                   detokenize=False) for r in requests]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=r.prompt_ids) for r in requests], sps,
                                 lora_request=self.lora, use_tqdm=False)
        results = []
        for r, o in zip(requests, outs):
            c = o.outputs[0]
            ids = list(c.token_ids)
            lps = [float(step[t].logprob) for step, t in zip(c.logprobs, ids)]
            results.append(Result(r.key, ids, lps, "stop" if c.finish_reason == "stop" else "length"))
        return results

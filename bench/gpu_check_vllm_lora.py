"""``bench/gpu_check.py`` stage ``vllm_lora``: vLLM's real MoE-LoRA kernels (the Triton ``fused_moe_lora`` path
``FusedMoEWithLoRA`` runs on CUDA) serving the trainer's full-stack adapter in LoRA mode, against transformers +
PEFT on the same GPU. Runs where vLLM imports (the GPU extra; the lent image has none: the stage says so).

A tiny GLM-5 with GLM-5's MLA widths (vLLM's MLA kernels need kv_lora_rank + qk_rope_head_dim = 576, its indexer
index_head_dim 128), bf16, DSA inactive (``index_topk`` above every sequence); an adapter of rank 8 on every family
vLLM serves as LoRA — MLA q_a / kv_a / q_b / o, the dense and shared MLPs, every routed expert (PEFT's fused 3D form:
``enable_mixed_moe_lora_format`` + ``is_3d_lora_weight``) — exported by the project (``glm5_mcore.lora.peft``) and
pushed in memory (``rl.rollout.vllm_adapters``). vLLM (``VLLMRolloutEngine``, ``merge=False``, in a child process)
samples greedily; transformers' ``GlmMoeDsaForCausalLM`` scores the same tokens with the adapter (PEFT) and without.
Checks: mean |vLLM − PEFT| log-prob ≤ 2e-2 (both bf16, different kernels), and the adapter's own effect
(|PEFT − base|) at least 5x that; the on-CPU proof of the same path with only these kernels replaced is
``tests/rl/test_vllm_certificate.py``.

Contract (``bench/gpu_check.py``): ``BUDGET_S``; ``stage(ctx)`` with ctx ``device``, ``deadline``, ``dry_run``,
``out_dir``. Alone: ``python bench/gpu_check_vllm_lora.py`` (without CUDA and vLLM: its plan).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BUDGET_S = 60
RANK = 8
TARGET_MEAN, EFFECT_OVER = 2e-2, 5.0
PLAN = ("tiny GLM-5 at GLM-5's MLA widths, bf16: vLLM in LoRA mode (routed experts in 3D, every family it serves) vs "
        f"transformers + PEFT on the same tokens; mean |d log-prob| <= {TARGET_MEAN}, the adapter's effect >= "
        f"{EFFECT_OVER}x that")


def _adapter(glm5, seed: int = 1):
    """Rank-``RANK`` adapters with B != 0 on every family vLLM serves (an ``AdapterState``)."""
    import torch

    from glm5_mcore.lora.state import AdapterState

    g, st = torch.Generator().manual_seed(seed), AdapterState()
    H, E, nh = glm5.hidden_size, glm5.n_routed_experts, glm5.num_attention_heads

    def add(m, out_f, in_f):
        st.A[m] = torch.randn(RANK, in_f, generator=g) / in_f ** 0.5
        st.B[m] = torch.randn(out_f, RANK, generator=g) * 0.05
        st.scale[m] = 2.0

    for layer in range(glm5.num_hidden_layers):
        p = f"decoder.layers.{layer}."
        add(p + "self_attention.linear_q_down_proj", glm5.q_lora_rank, H)
        add(p + "self_attention.linear_kv_down_proj", glm5.kv_lora_rank + glm5.qk_rope_head_dim, H)
        add(p + "self_attention.linear_q_up_proj", nh * glm5.qk_head_dim, glm5.q_lora_rank)
        add(p + "self_attention.linear_proj", H, nh * glm5.v_head_dim)
        if glm5.mlp_layer_types[layer] != "sparse":
            add(p + "mlp.linear_fc1", 2 * glm5.intermediate_size, H)
            add(p + "mlp.linear_fc2", H, glm5.intermediate_size)
            continue
        s = glm5.shared_expert_intermediate_size
        add(p + "mlp.shared_experts.linear_fc1", 2 * s, H)
        add(p + "mlp.shared_experts.linear_fc2", H, s)
        for e in range(E):
            add(p + f"mlp.experts.local_experts.{e}.linear_fc1", 2 * glm5.moe_intermediate_size, H)
            add(p + f"mlp.experts.local_experts.{e}.linear_fc2", H, glm5.moe_intermediate_size)
    return st


def _score(model, prompts, results):
    """Log-probs of each result's tokens under ``model`` (transformers), [sum of response lengths]."""
    import torch

    out = []
    with torch.no_grad():
        for p, r in zip(prompts, results):
            ids = torch.tensor([list(p) + list(r.response_ids)], device=model.device)
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            n = len(p)
            tok = torch.tensor(r.response_ids, device=model.device)
            out.append(logp[n - 1: n - 1 + len(tok)].gather(1, tok[:, None])[:, 0])
    return torch.cat(out).cpu()


def stage(ctx: dict) -> dict:
    if ctx["dry_run"]:
        return {"plan": PLAN}
    if importlib.util.find_spec("vllm") is None or ctx["device"].type != "cuda":
        return {"skipped": "needs CUDA and vLLM (the GPU extra; not in the lent image)"}
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from glm5_mcore.config import glm5_744b, glm5_tiny
    from glm5_mcore.lora.peft import peft_files
    from glm5_mcore.tiny import random_hf_state_dict, write_hf_checkpoint
    from rl.rollout.base import AdapterPayload, Request, SamplingParams
    from rl.rollout.vllm_engine import VLLMRolloutEngine

    real = glm5_744b()
    cfg = dataclasses.replace(glm5_tiny(), kv_lora_rank=real.kv_lora_rank, qk_rope_head_dim=real.qk_rope_head_dim,
                              qk_nope_head_dim=real.qk_nope_head_dim, v_head_dim=real.v_head_dim, q_lora_rank=256,
                              index_head_dim=real.index_head_dim, torch_dtype="bfloat16")
    out_dir = Path(ctx["out_dir"])
    sd = {k: v.to(torch.bfloat16) for k, v in random_hf_state_dict(cfg, seed=0).items()}
    hf_dir = str(write_hf_checkpoint(cfg, sd, out_dir / "tiny_mla576", overwrite=True))
    files = peft_files(_adapter(cfg), cfg.num_hidden_layers, cfg.n_routed_experts, dtype=torch.bfloat16)
    adapter_dir = out_dir / "adapter"
    adapter_dir.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (adapter_dir / name).write_bytes(data)
    prompts = [[3, 4, 6, 20 + i, 21 + i, 7] for i in range(8)]
    reqs = [Request((i, 0), p, i) for i, p in enumerate(prompts)]
    t0 = time.monotonic()
    engine = VLLMRolloutEngine(hf_dir, merge=False, dtype="bfloat16", gpu_memory_utilization=0.3, max_lora_rank=RANK,
                               max_loras=2, enforce_eager=True, max_model_len=256, vllm_python=sys.executable,
                               deterministic_topk=False)
    try:
        start_s = time.monotonic() - t0
        engine.load_adapter(AdapterPayload(1, files))
        push = engine.last_push()
        res = engine.generate(reqs, SamplingParams(0.0, 1.0, 12, ()))
    finally:
        engine.close()
    if time.monotonic() > ctx["deadline"] - 5:
        return {"skipped": "deadline"}
    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).cuda().eval()
    ref_base = _score(base, prompts, res)
    peft = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    ref = _score(peft, prompts, res)
    ours = torch.tensor([x for r in res for x in r.logprobs])
    mean, effect = float((ours - ref).abs().mean()), float((ref - ref_base).abs().mean())
    out = {"vllm_start_s": round(start_s, 1), "push_lora_bytes": push.get("lora_bytes"),
           "push_s": round(push.get("seconds", 0.0), 3), "mean_abs_vs_peft": mean,
           "max_abs_vs_peft": float((ours - ref).abs().max()), "adapter_effect_mean": effect,
           "targets": {"mean_abs_vs_peft": f"<= {TARGET_MEAN}", "adapter_effect_mean": f">= {EFFECT_OVER} x mean"}}
    out["ok"] = mean <= TARGET_MEAN and effect >= EFFECT_OVER * mean and bool(push.get("lora_bytes"))
    return out


if __name__ == "__main__":
    import argparse
    import json
    import tempfile

    import torch

    argparse.ArgumentParser(description="bench/gpu_check.py's vllm_lora stage alone (without CUDA and vLLM: its "
                                        "plan); one JSON line").parse_args()
    ready = torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None
    print(json.dumps(stage({"device": torch.device("cuda" if ready else "cpu"), "deadline": time.monotonic() + BUDGET_S,
                            "dry_run": not ready, "out_dir": tempfile.mkdtemp()})))

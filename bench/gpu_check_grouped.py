"""``bench/gpu_check.py`` stage ``grouped_lora``: LoRA on grouped routed experts on the device, what a run with
``model.moe_grouped_gemm=true`` (the TE spec's default) and ``experts.*`` targets computes.

The tiny model with ``TEGroupedMLP`` experts (the local spec's ``cpu_compat.GroupedLinear``; TE's own where the
TE spec runs), bf16, adapters of rank 8 on ``experts.linear_fc1`` / ``experts.linear_fc2``: one forward and
backward through the stacked ``torch.nn.functional.grouped_mm`` path of ``glm5_mcore.lora.grouped`` (two grouped
GEMMs per grouped linear, no loop over experts) and one through the per-expert path, on the same weights and batch.
Figures: the largest logit difference relative to the largest logit, the largest adapter-gradient difference
relative to that gradient's largest entry, and the synchronizing CUDA calls made from ``lora/grouped.py`` (PyTorch's
``set_sync_debug_mode``: the offsets go to the device pinned and non-blocking). Checks: the stacked path ran in
every grouped linear and the per-expert run in none, logits within 2e-2 and gradients within 3e-2 (bf16 rounding
in another summation order), no sync from the adapters' path.

Contract (``bench/gpu_check.py``): ``BUDGET_S``; ``stage(ctx)`` with ctx ``device``, ``deadline``, ``dry_run``,
``hf_dir``. Alone: ``python bench/gpu_check_grouped.py`` (without CUDA: its plan).
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BUDGET_S = 20
TARGETS = ("experts.linear_fc1", "experts.linear_fc2")
TOKENS = 96
TARGET_LOGITS, TARGET_GRADS = 2e-2, 3e-2


def _pass(model, ids, grouped, stacked: bool) -> dict:
    """Logits, adapter gradients, grouped_mm calls and the syncs from the adapters' code of one forward + backward."""
    import torch

    from glm5_mcore.model.build import forward_logits

    grouped.GROUPED_MM_DEVICES = {"cuda"} if stacked else set()
    calls, real = [], grouped.grouped_delta
    grouped.grouped_delta = lambda *a: calls.append(1) or real(*a)
    model.zero_grad(set_to_none=True)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                logits = forward_logits(model, ids)
                logits.float().logsumexp(-1).mean().backward()
                torch.cuda.synchronize()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        grouped.grouped_delta, grouped.GROUPED_MM_DEVICES = real, {"cuda"}
    syncs = [f"{Path(w.filename).name}:{w.lineno}" for w in seen if "synchroniz" in str(w.message)]
    return {"logits": logits.detach().float(), "calls": len(calls), "syncs": syncs,
            "grads": {n: p.grad.float().clone() for n, p in model.named_parameters() if ".lora." in n}}


def stage(ctx: dict) -> dict:
    if ctx["dry_run"]:
        return {"plan": f"tiny model, moe_grouped_gemm=true, bf16, LoRA r=8 on {list(TARGETS)}: the stacked "
                        "grouped_mm path vs the per-expert one (logits, every adapter gradient), syncs from "
                        "lora/grouped.py under torch.cuda.set_sync_debug_mode"}
    if ctx["device"].type != "cuda":
        return {"skipped": "needs a CUDA device (the CPU's grouped_mm has no backward)"}
    import torch

    from glm5_mcore.checkpoint.hf_load import load_hf_weights
    from glm5_mcore.config import GLM5Config
    from glm5_mcore.lora import grouped
    from glm5_mcore.lora.apply import apply_lora
    from glm5_mcore.lora.config import LoRAConfig
    from glm5_mcore.mcore_settings import ParallelConfig
    from glm5_mcore.model.build import build_model

    glm5 = GLM5Config.from_hf_dir(ctx["hf_dir"])
    model = build_model(glm5, ParallelConfig(), moe_grouped_gemm=True, bf16=True, params_dtype=torch.bfloat16)
    load_hf_weights(model, ctx["hf_dir"], glm5)
    apply_lora(model, LoRAConfig(rank=8, alpha=16, targets=TARGETS, init="random", seed=1), "default")
    ids = torch.randint(3, glm5.vocab_size, (1, TOKENS), generator=torch.Generator().manual_seed(0)).to(ctx["device"])
    runs = {}
    for stacked in (True, False):
        if time.monotonic() > ctx["deadline"] - 3:
            return {"skipped": "deadline"}
        runs[stacked] = _pass(model, ids, grouped, stacked)
    s, e = runs[True], runs[False]
    logits_rel = float((s["logits"] - e["logits"]).abs().max() / e["logits"].abs().max())
    grad_rel = {n: float((g - e["grads"][n]).abs().max() / e["grads"][n].abs().max().clamp(min=1e-30))
                for n, g in s["grads"].items()}
    worst = max(grad_rel, key=grad_rel.get) if grad_rel else None
    lora_syncs = [x for x in s["syncs"] if x.startswith(("grouped.py", "device.py"))]
    moe_layers = sum(glm5.moe_layer_pattern)
    out = {"grouped_linears": 2 * moe_layers, "stacked_calls": s["calls"], "per_expert_run_stacked_calls": e["calls"],
           "logits_rel": logits_rel, "adapter_grads": len(grad_rel),
           "grad_rel_max": grad_rel.get(worst, 0.0), "grad_rel_max_at": worst,
           "syncs_from_lora_grouped": lora_syncs, "syncs_total": len(s["syncs"]),
           "targets": {"logits_rel": f"<= {TARGET_LOGITS}", "grad_rel_max": f"<= {TARGET_GRADS}",
                       "syncs_from_lora_grouped": "none"}}
    every = len(grad_rel) == 4 * moe_layers * glm5.n_routed_experts  # A and B of fc1 and fc2, every expert
    out["ok"] = (s["calls"] == 2 * moe_layers and e["calls"] == 0 and every and logits_rel <= TARGET_LOGITS
                 and out["grad_rel_max"] <= TARGET_GRADS and not lora_syncs)
    return out


if __name__ == "__main__":
    import argparse
    import json

    import torch

    argparse.ArgumentParser(description="bench/gpu_check.py's grouped_lora stage alone (without CUDA: its plan); "
                                        "one JSON line").parse_args()
    cuda = torch.cuda.is_available()
    ctx = {"device": torch.device("cuda" if cuda else "cpu"), "deadline": time.monotonic() + BUDGET_S,
           "dry_run": not cuda, "hf_dir": None}
    if cuda:
        import tempfile

        from glm5_mcore.mcore_settings import ParallelConfig
        from glm5_mcore.model.parallel import init_parallel
        from glm5_mcore.tiny import write_tiny

        init_parallel(ParallelConfig())
        ctx["hf_dir"] = str(write_tiny(Path(tempfile.mkdtemp()) / "tiny", seed=0))
    print(json.dumps(stage(ctx)))

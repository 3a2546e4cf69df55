"""``bench/gpu_check.py`` stage: Megatron-Core's fused DSA kernels on the first GPU, against this project's
reference, then timed at GLM-5's real widths.

1. Correctness (4K tokens, 16 local heads = 64 / TP 4): the fused indexer top-k (``run_fused_qk_topk``)
   against ``compute_index_topk`` on the same bf16 tensors (set agreement per row, and exact on rows
   without a tie at the K-th score), and the fused absorbed SparseMLA (``run_fused_absorbed_sparse_attention``)
   against ``SparseLatentAttention`` (this project's PyTorch path) on the same top-k: max |Δ| of the output
   and of dq / dlatent. The PyTorch path runs on the GPU too (it computes the CPU kernels' function).
2. Scaling at 4K / 10K / 32K tokens, 8 local heads (TP 8, the presets' layout): forward + backward time,
   ``torch.cuda.max_memory_allocated`` over the core, the planner's prediction
   (``plan.activations.core_attention_bytes`` + the top-k) beside it; flash SDPA dense attention over
   the same per-head widths (192 + 64 / 256) beside it; the FLOP ideal (sparse / dense FLOPs).

Contract (``bench/gpu_check.py``): ``BUDGET_S`` and ``stage(ctx) -> dict``; ctx has ``device``,
``deadline`` (``time.monotonic()``), ``dry_run``, ``out_dir``. TileLang is imported lazily (it must be
carried onto the machine: ``pip install 'glm5-mcore[gpu]'`` or the wheel).
"""

from __future__ import annotations

import time

BUDGET_S = 150
WIDTHS = dict(dn=192, dr=64, dv=256, dc=512, nI=32, dI=128, K=2048)
SEQS = (4096, 10240, 32768)


def _config(heads: int):
    """A Megatron-Core config carrying what the hooks read (backend, widths), bf16."""
    import torch
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    w = WIDTHS
    cfg = MLATransformerConfig(num_layers=1, hidden_size=6144, num_attention_heads=heads, multi_latent_attention=True,
                                q_lora_rank=2048, kv_lora_rank=w["dc"], qk_head_dim=w["dn"], qk_pos_emb_head_dim=w["dr"],
                                v_head_dim=w["dv"], dsa_indexer_n_heads=w["nI"], dsa_indexer_head_dim=w["dI"],
                                dsa_indexer_topk=w["K"], dsa_kernel_backend="none", bf16=True,
                                params_dtype=torch.bfloat16, add_bias_linear=False)
    cfg.dsa_kernel_backend = "tilelang"  # after Megatron's validation, so the dry run builds it without CUDA
    return cfg


def _inputs(T: int, heads: int, dev, seed: int = 0):
    import torch

    w = WIDTHS
    g = torch.Generator(device=dev).manual_seed(seed)
    r = lambda *s, scale=1.0: (scale * torch.randn(*s, generator=g, device=dev)).to(torch.bfloat16)  # noqa: E731
    D = w["dc"] + w["dr"]
    return dict(q_i=r(T, 1, w["nI"], w["dI"]), k_i=r(T, 1, w["dI"]), w_i=r(T, 1, w["nI"], scale=0.05).float(),
                q_cat=r(T, 1, heads, D, scale=0.3), lat=r(T, 1, D), q_pos=torch.arange(T, device=dev),
                doc_start=torch.zeros(T, dtype=torch.int64, device=dev))


def _check(dev, heads: int = 16, T: int = 4096) -> dict:
    import torch

    from glm5_mcore.model import dsa_backend
    from glm5_mcore.model.sparse_attention import SparseLatentAttention, compute_index_topk

    cfg = _config(heads)
    dsa_backend.check(cfg, tp=1, trains_indexer=True)
    x = _inputs(T, heads, dev)
    w = WIDTHS
    fused = dsa_backend.fused_topk(cfg, x["q_i"], x["k_i"], x["w_i"], w["K"], x["doc_start"], x["q_pos"] + 1, 1 << 30)
    ref = compute_index_topk(x["q_i"].float(), x["k_i"].float(), x["w_i"], w["K"], x["q_pos"], x["doc_start"], True)
    if fused is None:
        return {"ok": False, "error": "run_fused_qk_topk declined the inputs"}
    key = lambda t: torch.where(t < 0, T, t.long()).sort(-1).values  # noqa: E731
    rows_equal = (key(fused) == key(ref)).all(-1).float().mean().item()
    overlap = (torch.isin(key(fused)[0], key(ref)[0]).float().mean()).item()
    scale = (w["dn"] + w["dr"]) ** -0.5
    q = x["q_cat"].clone().requires_grad_()
    lat = x["lat"].clone().requires_grad_()
    out_f = dsa_backend.fused_core(cfg)(q, lat.unsqueeze(2), ref.to(torch.int32), scale, w["dc"])
    if out_f is None:
        return {"ok": False, "error": "run_fused_absorbed_sparse_attention declined the inputs"}
    dout = torch.randn_like(out_f)
    gq_f, gl_f = torch.autograd.grad(out_f, (q, lat), dout)
    out_r = SparseLatentAttention.apply(q[:, 0], lat[:, 0], ref[0], scale, w["dc"])
    gq_r, gl_r = torch.autograd.grad(out_r, (q, lat), dout[:, 0])
    rel = lambda a, b: float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6))  # noqa: E731
    res = {"topk_rows_equal": rows_equal, "topk_overlap": overlap, "out_rel_maxdiff": rel(out_f[:, 0], out_r),
           "dq_rel_maxdiff": rel(gq_f, gq_r), "dlat_rel_maxdiff": rel(gl_f, gl_r)}
    res["ok"] = overlap > 0.99 and max(res["out_rel_maxdiff"], res["dq_rel_maxdiff"], res["dlat_rel_maxdiff"]) < 2e-2
    return res


def _flops(T: int, heads: int, sparse: bool) -> float:
    w = WIDTHS
    if sparse:  # absorbed: q·lat over K keys (576) + p·lat (512), x3 for fwd+bwd
        kept = T * min(w["K"], T) - w["K"] * (w["K"] - 1) / 2
        return 3 * 2 * kept * heads * (w["dc"] + w["dr"] + w["dc"])
    return 3 * 2 * T * (T + 1) / 2 * heads * (w["dn"] + w["dr"] + w["dv"])


def _time(fn, reps: int = 3) -> float:
    import torch

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def _scale(dev, T: int, heads: int = 8) -> dict:
    import torch
    import torch.nn.functional as F

    from glm5_mcore.config import glm5_744b
    from glm5_mcore.model import dsa_backend
    from glm5_mcore.model.sparse_attention import compute_index_topk
    from glm5_mcore.plan.activations import core_attention_bytes
    from glm5_mcore.plan.layout import Layout

    cfg, w = _config(heads), WIDTHS
    x = _inputs(T, heads, dev)
    topk = dsa_backend.fused_topk(cfg, x["q_i"], x["k_i"], x["w_i"], w["K"], x["doc_start"], x["q_pos"] + 1, 1 << 30)
    if topk is None:
        topk = compute_index_topk(x["q_i"].float(), x["k_i"].float(), x["w_i"], w["K"], x["q_pos"], x["doc_start"], True)
    core = dsa_backend.fused_core(cfg)
    scale = (w["dn"] + w["dr"]) ** -0.5
    q = x["q_cat"].requires_grad_()
    lat = x["lat"].requires_grad_()

    def sparse():
        out = core(q, lat.unsqueeze(2), topk, scale, w["dc"])
        out.backward(torch.ones_like(out))

    t_idx = _time(lambda: dsa_backend.fused_topk(cfg, x["q_i"], x["k_i"], x["w_i"], w["K"], x["doc_start"],
                                                 x["q_pos"] + 1, 1 << 30))
    torch.cuda.reset_peak_memory_stats(dev)
    base = torch.cuda.memory_allocated(dev)
    t_sparse = _time(sparse)
    peak = torch.cuda.max_memory_allocated(dev) - base
    qd = torch.randn(1, heads, T, w["dn"] + w["dr"], device=dev, dtype=torch.bfloat16, requires_grad=True)
    kd = torch.randn_like(qd, requires_grad=True)
    vd = torch.randn(1, heads, T, w["dv"], device=dev, dtype=torch.bfloat16, requires_grad=True)

    def dense():
        out = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=scale)
        out.backward(torch.ones_like(out))

    t_dense = _time(dense)
    m = glm5_744b()
    planned = core_attention_bytes(m, Layout(world=8, tp=8), T, 2, fused=True)
    return {"tokens": T, "heads": heads, "indexer_topk_s": t_idx, "sparse_core_fwd_bwd_s": t_sparse,
            "dense_sdpa_fwd_bwd_s": t_dense, "sparse_over_dense": t_sparse / t_dense,
            "flop_ideal_sparse_over_dense": _flops(T, heads, True) / _flops(T, heads, False),
            "max_memory_allocated_gib": peak / 2**30, "planner_saved_gib": planned / 2**30}


def stage(ctx: dict) -> dict:
    if ctx.get("dry_run"):
        return {"plan": f"fused DSA (TileLang) vs the PyTorch reference at 4K x 16 heads; fused core + indexer "
                        f"timed at {'/'.join(str(t) for t in SEQS)} tokens x 8 heads with flash SDPA beside it"}
    dev = ctx["device"]
    if dev.type != "cuda":
        return {"skipped": f"the fused kernels run on CUDA only (device {dev.type})"}
    out = {"check": _check(dev)}
    out["scaling"] = []
    for T in SEQS:
        if time.monotonic() > ctx["deadline"] - 20:
            out["scaling"].append({"tokens": T, "skipped": "deadline"})
            continue
        out["scaling"].append(_scale(dev, T))
    out["ok"] = bool(out["check"].get("ok"))
    return out


if __name__ == "__main__":
    import argparse
    import json
    import pathlib

    import torch

    argparse.ArgumentParser(description="bench/gpu_check.py's DSA stage alone (without CUDA: its plan); one JSON "
                                        "line").parse_args()
    print(json.dumps(stage({"device": torch.device("cuda"), "deadline": time.monotonic() + BUDGET_S,
                            "dry_run": not torch.cuda.is_available(), "out_dir": pathlib.Path(".")})))

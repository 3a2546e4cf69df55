"""DSA sparse attention vs dense attention (same module) vs HF's attention, forward + backward.

One MLA + DSA attention layer at GLM-5's proportions scaled down (hidden 512, 4 heads, q/k head
64 = nope 48 + rope 16, v head 64, indexer 4 heads x 32), k = 512, T = 2048 / 4096 / 8192, batch 1,
fp32, 1 thread. "dense" is the same module with index_topk >= T (the indexer is skipped, causal SDPA);
"hf" is transformers' GlmMoeDsaAttention (eager, dense scores + DSA mask). Each (impl, T) runs in
its own process so peak RSS is its own. The ideal speed-up counts FLOPs of the whole layer
(projections, attention over the kept keys, and the indexer's own T² scoring). "sparse+loss" is the
sparse layer in the sparse training stage (trainable indexer, Megatron-Core's sparse KL indexer loss over
the selected keys + the top-k recall on 128 rows): its time and memory over plain "sparse" is the cost of
the indexer keeping on learning. Beside them, of the sparse core on the device (PyTorch) path: the host
syncs per layer (ops that read a device value back) and the bytes kept for backward per token per head.
The JSON line carries the targets (``targets``: each one's value and whether it is met; ``target_met``: all):
issue 29's speed, ``sparse_vs_dense_8192 >= 1.0`` on any CPU (AVX2-only included: ``cpu_vector_isa``), and
issue 43's memory and sparse-stage cost, ``rss_sparse_vs_dense_8192 <= 1.2`` (peak RSS) and
``sparse_loss_vs_sparse_8192 <= 2.0`` (time; the targets' times are process CPU times, one thread: the
wall time on a quiet machine), with the machine's load average at the start and the end
(ratios taken on a loaded machine are rough; ``--rounds`` interleaves several processes per implementation
and keeps the least disturbed). The device-path figures (host syncs, saved bytes) run the PyTorch path after
the timed steps and the peak RSS are read: its 1 GiB chunks are no CPU figure (they were, before: the
sparse layer's 1,857 MiB peak RSS at T = 8192 was that path's).

Usage: .venv/bin/python bench/dsa_attention.py [--seqs 2048 4096 8192] [--reps 2] [--rounds 1]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

H, NH, RQ, RKV, DN, DR, DV, NI, DI, K = 512, 4, 128, 64, 48, 16, 64, 4, 32, 512


def flops(T: int, sparse: bool) -> float:
    """Forward + backward (x3) FLOPs of one layer; the indexer runs forward only, over all T²."""
    proj = 2 * T * (H * RQ + RQ * NH * (DN + DR) + H * (RKV + DR) + RKV * NH * (DN + DV) + NH * DV * H)
    kept = T * min(K, T) - K * (K - 1) / 2 if sparse else T * (T + 1) / 2
    attn = 2 * kept * NH * (DN + DR + DV)
    indexer = 2 * T * T * NI * DI + 2 * T * (RQ * NI * DI + H * DI + H * NI) if sparse else 0
    return 3 * (proj + attn) + indexer


def _glm5():
    from glm5_mcore.config import glm5_tiny

    c = glm5_tiny()
    for k, v in dict(hidden_size=H, num_attention_heads=NH, num_key_value_heads=NH, q_lora_rank=RQ,
                     kv_lora_rank=RKV, qk_nope_head_dim=DN, qk_rope_head_dim=DR, v_head_dim=DV,
                     index_n_heads=NI, index_head_dim=DI, index_topk=K, num_hidden_layers=1,
                     first_k_dense_replace=1, mlp_layer_types=["dense"], indexer_types=["full"],
                     max_position_embeddings=16384).items():
        setattr(c, k, v)
    return c


def run_one(impl: str, T: int, reps: int) -> dict:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    x = torch.randn(T, 1, H) * 0.5
    if impl == "hf":
        from transformers import GlmMoeDsaConfig
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
            GlmMoeDsaAttention, GlmMoeDsaRotaryEmbedding)

        cfg = GlmMoeDsaConfig(**_glm5().to_hf_dict())
        cfg._attn_implementation = "eager"
        attn = GlmMoeDsaAttention(cfg, layer_idx=0)
        rope = GlmMoeDsaRotaryEmbedding(cfg)
        xb = x.transpose(0, 1).contiguous().requires_grad_(True)
        pos = torch.arange(T)[None]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]

        def step():
            out = attn(xb, position_embeddings=rope(xb, pos), attention_mask=mask)[0]
            out.sum().backward()
    else:
        from glm5_mcore.mcore_settings import ParallelConfig
        from glm5_mcore.model.build import build_model
        from glm5_mcore.model.parallel import init_parallel

        glm5 = _glm5()
        if impl == "dense":
            glm5.index_topk = T
        init_parallel(ParallelConfig())
        model = build_model(glm5, dsa_indexer_loss_coeff=0.001 if impl == "sparse+loss" else 0.0)
        attn = model.decoder.layers[0].self_attention
        xs = x.clone().requires_grad_(True)

        def step():
            out, _ = attn(xs, None)
            out.sum().backward()

    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # the model and inputs built
    step()  # warm-up
    times, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # after the peak is read: the device-path figures run the PyTorch path, whose 1 GiB chunks are no CPU figure
    extra = core_figures(attn, lambda: attn(xs, None)[0], T) if impl == "sparse" else {}
    return {"impl": impl, "T": T, "time_s": min(times), "cpu_s": min(cpu), "peak_rss_mib": peak / 1024, "rss_growth_mib": (peak - base) / 1024,
            **extra}


def core_figures(attn, forward, T: int) -> dict:
    """Of the DSA core on the device (PyTorch) path, one forward + backward: the ops that read a device value
    back to the host (on CUDA each is a sync; ``tests/support/host_reads.SYNC_OPS``) and the bytes it keeps
    for backward per token per local head (unique storages, ``saved_tensors_hooks``; the latent rows and
    top-k shared by all heads excluded)."""
    import torch
    from torch.multiprocessing.reductions import StorageWeakRef
    from torch.utils._python_dispatch import TorchDispatchMode

    from glm5_mcore import kernels
    from glm5_mcore.probes.host_reads import SYNC_OPS

    core = attn.core_attention
    syncs, saved, on = [0], {}, [False]

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if on[0] and func in SYNC_OPS:
                syncs[0] += 1
            return func(*args, **(kwargs or {}))

    def pack(x):
        if on[0] and x.dim() >= 2 and (x.shape[-1] == NH or x.dim() >= 3 and x.shape[-2] == NH):  # per-head, kept by the core
            saved.setdefault(StorageWeakRef(x.untyped_storage()), x.untyped_storage().nbytes())
        return x

    hooks = [core.register_forward_pre_hook(lambda *_: on.__setitem__(0, True)),
             core.register_forward_hook(lambda *_: on.__setitem__(0, False))]
    try:
        with kernels.disabled(), Count(), torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            out = forward()
            on[0] = True  # the whole backward
            out.sum().backward()
    finally:
        for h in hooks:
            h.remove()
    return {"host_syncs_per_layer": syncs[0], "saved_bytes_per_token_per_head_fp32": sum(saved.values()) / (T * NH)}


def cpu_vector_isa() -> str:
    """The widest vector ISA the kernels are built for on this CPU (``-march=native``)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next((l for l in f if l.startswith("flags")), "").split())
    except OSError:
        return "unknown"
    return next((isa for isa in ("avx512f", "avx2", "avx") if isa in flags), "sse2")


def _run(impl: str, T: int, reps: int, env: dict) -> dict:
    r = subprocess.run([sys.executable, __file__, "--one", impl, str(T), "--reps", str(reps)],
                       env=env, capture_output=True, text=True)
    line = [l for l in r.stdout.splitlines() if l.startswith("{")]
    if r.returncode or not line:
        raise SystemExit(f"{impl} T={T} failed:\n{r.stderr[-3000:]}")
    return json.loads(line[-1])


TARGETS = {"sparse_vs_dense_8192": (">=", 1.0), "rss_sparse_vs_dense_8192": ("<=", 1.2),
           "sparse_loss_vs_sparse_8192": ("<=", 2.0)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seqs", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--reps", type=int, default=2, help="timed steps per process (the minimum is kept)")
    p.add_argument("--rounds", type=int, default=1,
                   help="processes per implementation, interleaved (sparse, sparse+loss, dense, ...): on a loaded "
                        "machine the minimum over rounds is the figure least disturbed; hf runs in round 1 only")
    p.add_argument("--one", nargs=2)
    a = p.parse_args()
    if a.one:
        print(json.dumps(run_one(a.one[0], int(a.one[1]), a.reps)))
        return
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = {"bench": "dsa_attention", "k": K, "threads": 1, "load_avg_start": os.getloadavg(), "rows": [],
           "about": {
               "time_s / cpu_s": "forward + backward of one attention layer, min over reps and rounds: wall time and "
                                 "process CPU time (CPU time is the steadier one on a loaded machine)",
               "sparse": "DSA layer, frozen indexer (the plain sparse stage), fused CPU kernels",
               "sparse+loss": "the sparse training stage: trainable indexer, Megatron-Core's sparse KL over the selected "
                              "keys (fused CPU kernels: the attention target and the KL, forward and gradients) and the "
                              "top-k recall on 128 rows",
               "dense": "the same module with index_topk >= T (no indexer, causal SDPA)",
               "hf": "transformers' GlmMoeDsaAttention, eager (dense scores + DSA mask)",
               "peak_rss_mib": "the process's peak RSS (ru_maxrss) over building the layer and its timed steps: "
                               "Python, torch and Megatron included; rss_growth_mib: the part above the built model",
               "ratios": "from the same run, each implementation in its own process; the targets' time ratios "
                         "(sparse_vs_dense_8192, sparse_loss_vs_sparse_8192) are of CPU time, the rows carry both"},
           "target_fraction_of_ideal_at_8192": 0.8}
    for T in a.seqs:
        res = {}
        for rnd in range(a.rounds):
            for impl in ("sparse", "sparse+loss", "dense") + (("hf",) if rnd == 0 else ()):
                r = _run(impl, T, a.reps, env)
                if impl not in res:
                    res[impl] = r
                else:
                    best = res[impl]
                    for k in ("time_s", "cpu_s"):
                        best[k] = min(best[k], r[k])
                    for k in ("peak_rss_mib", "rss_growth_mib"):
                        best[k] = max(best[k], r[k])
        ideal = flops(T, False) / flops(T, True)
        sp, sl, de, hf = res["sparse"], res["sparse+loss"], res["dense"], res["hf"]
        speed = de["time_s"] / sp["time_s"]
        row = {"T": T, "sparse_s": sp["time_s"], "sparse_loss_s": sl["time_s"], "dense_s": de["time_s"],
               "hf_s": hf["time_s"], "cpu_s": {k: v["cpu_s"] for k, v in res.items()},
               "speedup_vs_dense": speed, "speedup_vs_dense_cpu": de["cpu_s"] / sp["cpu_s"], "ideal_speedup": ideal,
               "fraction_of_ideal": speed / ideal, "speedup_vs_hf": hf["time_s"] / sp["time_s"],
               "peak_rss_mib": {k: v["peak_rss_mib"] for k, v in res.items()},
               "rss_growth_mib": {k: v["rss_growth_mib"] for k, v in res.items()},
               "rss_sparse_vs_dense": sp["peak_rss_mib"] / de["peak_rss_mib"],
               "mem_ratio_sparse_vs_hf": sp["peak_rss_mib"] / hf["peak_rss_mib"],
               "indexer_loss_time_ratio": sl["time_s"] / sp["time_s"],
               "indexer_loss_time_ratio_cpu": sl["cpu_s"] / sp["cpu_s"],
               "indexer_loss_mem_ratio": sl["peak_rss_mib"] / sp["peak_rss_mib"],
               "host_syncs_per_layer": sp["host_syncs_per_layer"],
               "saved_bytes_per_token_per_head_fp32": sp["saved_bytes_per_token_per_head_fp32"]}
        out["rows"].append(row)
        print(f"T={T:5d}  sparse {row['sparse_s']:.3f}s  dense {row['dense_s']:.3f}s  hf {row['hf_s']:.3f}s  "
              f"speed-up vs dense {speed:.2f}x (CPU time {row['speedup_vs_dense_cpu']:.2f}x; ideal {ideal:.2f}x, "
              f"{speed / ideal:.0%})  vs hf {row['speedup_vs_hf']:.2f}x  peak RSS MiB sparse/dense/hf "
              f"{row['peak_rss_mib']['sparse']:.0f}/{row['peak_rss_mib']['dense']:.0f}/{row['peak_rss_mib']['hf']:.0f} "
              f"(sparse/dense {row['rss_sparse_vs_dense']:.2f}x)  sparse+indexer loss {row['sparse_loss_s']:.3f}s "
              f"({row['indexer_loss_time_ratio']:.2f}x time, CPU time {row['indexer_loss_time_ratio_cpu']:.2f}x, "
              f"{row['indexer_loss_mem_ratio']:.2f}x RSS)  device path: {row['host_syncs_per_layer']} host syncs per "
              f"layer, {row['saved_bytes_per_token_per_head_fp32']:.0f} B saved per token per head (fp32)", flush=True)
    last = out["rows"][-1]
    out["fraction_of_ideal_at_max_T"] = last["fraction_of_ideal"]
    out["pass"] = last["T"] == 8192 and last["fraction_of_ideal"] >= 0.8
    at = {r["T"]: r for r in out["rows"]}.get(8192)
    # times: process CPU time (1 thread: the wall time on a quiet machine, steadier on a loaded one)
    got = {"sparse_vs_dense_8192": at and at["speedup_vs_dense_cpu"],  # on any CPU, AVX2-only included (issue 29)
           "rss_sparse_vs_dense_8192": at and at["rss_sparse_vs_dense"],  # issue 43 item 6
           "sparse_loss_vs_sparse_8192": at and at["indexer_loss_time_ratio_cpu"]}  # issue 43 item 6
    out["targets"] = {k: {"target": f"{TARGETS[k][0]} {TARGETS[k][1]}", "value": v,
                          "met": v is not None and (v >= TARGETS[k][1] if TARGETS[k][0] == ">=" else v <= TARGETS[k][1])}
                      for k, v in got.items()}
    out["target"] = "; ".join(f"{k} {op} {x}" for k, (op, x) in TARGETS.items())
    out.update(got)
    out["target_met"] = all(t["met"] for t in out["targets"].values())
    out["cpu_vector_isa"] = cpu_vector_isa()
    out["load_avg_end"] = os.getloadavg()
    print(json.dumps(out))


if __name__ == "__main__":
    main()

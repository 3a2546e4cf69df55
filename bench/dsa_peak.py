"""One DSA layer's peak memory at full width against the planner's DSA lines, side by side in one run.

GLM-5's DSA core (``GLM5SparseAttention``: Megatron-Core's indexer, the device path's chunked top-k, the
absorbed sparse core, W_uv) runs forward and backward on meta tensors (nothing is allocated) at 64 heads /
TP, the 576-wide latent, a 32 x 128 indexer and top-k 2048, with ``glm5_mcore/probes/live_bytes.py`` booking
every tensor it makes (``glm5_mcore/probes/dsa_peak.py``), in each training stage of the indexer:
``sparse`` (frozen), ``sparse_loss`` (trainable, the sparse KL), ``warmup`` (dense attention + the dense KL),
one rank of TP x CP, unpacked or THD-packed (``thd``: the warm-up's attention then takes an [s, T] mask, as
SFT and RL pack). Printed per case: the measured peak above the core's inputs and where it falls, the
bytes kept between forward and backward, the planner's line (``dsa_core_peak``, PyTorch path) and their
ratio, the planner's line without the attention kernel's own workspace (the warm-up's flash-attention dq
accumulator, by reading: meta tensors do not see a kernel's buffers; the measured peak is compared with
this one) and the planner's line for the fused TileLang path (not measurable here). The JSON line's target:
every ratio within 5 %.

Usage: .venv/bin/python bench/dsa_peak.py [--cases T,TP[,STAGE[,CP[,thd]]] ...]
  e.g. --cases 32768,8 32768,8,sparse_loss 32768,8,warmup,1,thd 32768,8,sparse,2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GIB = 2**30
CASES = ["32768,8", "32768,1", "131072,8", "131072,1", "32768,8,sparse_loss", "32768,8,warmup",
         "32768,8,warmup,1,thd", "32768,8,sparse,2", "32768,8,sparse_loss,2", "32768,8,warmup,2",
         "32768,1,warmup,1,thd"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=CASES)
    a = ap.parse_args()

    from glm5_mcore.config import glm5_744b
    from glm5_mcore.mcore_settings import ParallelConfig
    from glm5_mcore.model.parallel import init_parallel
    from glm5_mcore.plan.activations import dsa_core_kept, dsa_core_peak
    from glm5_mcore.plan.layout import Layout
    from glm5_mcore.probes.dsa_peak import build_core, measure_core_peak

    init_parallel(ParallelConfig())
    m = glm5_744b()
    cores = {}
    rows = []
    print(f"{'stage':>11} {'tokens':>7} {'TP':>3} {'CP':>3} {'THD':>4} {'measured GiB':>13} {'(phase)':>10} "
          f"{'kept GiB':>9} {'planned':>8} {'ratio':>6} {'planned -ws':>12} {'ratio':>6} {'kept ratio':>10} "
          f"{'fused':>7} {'s':>5}")
    for case in a.cases:
        f = case.split(",")
        T, tp = int(f[0]), int(f[1])
        stage = f[2] if len(f) > 2 else "sparse"
        cp = int(f[3]) if len(f) > 3 else 1
        thd = len(f) > 4 and f[4] == "thd"
        t0 = time.perf_counter()
        core = cores.setdefault(stage, build_core(m, stage))
        r = measure_core_peak(m, T, tp, core, stage=stage, cp=cp, thd=thd)
        L = Layout(world=tp * cp, tp=tp, cp=cp)
        kw = dict(stage=stage, masked=thd or cp > 1)
        planned = dsa_core_peak(m, L, T, 2, fused=False, **kw)
        seen = dsa_core_peak(m, L, T, 2, fused=False, workspace=False, **kw)
        kept = dsa_core_kept(m, L, T, 2, fused=False, **kw)
        fused = dsa_core_peak(m, L, T, 2, fused=True, **kw)
        dt = time.perf_counter() - t0
        rows.append({"stage": stage, "tokens": T, "tp": tp, "cp": cp, "thd": thd,
                     "measured_gib": round(r["peak"] / GIB, 3), "phase": r["phase"],
                     "forward_peak_gib": round(r["forward_peak"] / GIB, 3), "kept_gib": round(r["held"] / GIB, 3),
                     "planned_gib": round(planned / GIB, 3), "ratio": round(planned / r["peak"], 4),
                     "planned_without_workspace_gib": round(seen / GIB, 3), "ratio_seen": round(seen / r["peak"], 4),
                     "planned_kept_gib": round(kept / GIB, 3), "kept_ratio": round(kept / r["held"], 4),
                     "fused_planned_gib": round(fused / GIB, 3)})
        print(f"{stage:>11} {T:>7} {tp:>3} {cp:>3} {'yes' if thd else 'no':>4} {r['peak'] / GIB:>13.3f} "
              f"{r['phase']:>10} {r['held'] / GIB:>9.3f} {planned / GIB:>8.3f} {planned / r['peak']:>6.3f} "
              f"{seen / GIB:>12.3f} {seen / r['peak']:>6.3f} {kept / r['held']:>10.3f} {fused / GIB:>7.3f} {dt:>5.1f}",
              flush=True)
    ok = all(abs(x["ratio_seen"] - 1) <= 0.05 and abs(x["kept_ratio"] - 1) <= 0.05 for x in rows)
    print(json.dumps({"bench": "dsa_peak", "cases": rows,
                      "target": "planned (without the kernel workspace meta tensors cannot see) / measured peak, "
                                "and planned / measured kept bytes, within 0.95-1.05 in every case",
                      "target_met": ok}))


if __name__ == "__main__":
    main()

"""One DSA layer's peak memory at full width against the planner's DSA line, side by side in one run.

GLM-5's DSA core (``GLM5SparseAttention``: Megatron-Core's indexer, the device path's chunked top-k, the
absorbed sparse core, W_uv) runs forward and backward on meta tensors (nothing is allocated) at 64 heads /
TP, the 576-wide latent, a 32 x 128 indexer and top-k 2048, with ``glm5_mcore/probes/live_bytes.py`` booking
every tensor it makes (``glm5_mcore/probes/dsa_peak.py``). Printed per (tokens, TP): the measured peak above
the core's inputs and where it falls, the bytes kept between forward and backward, the planner's
``dsa_core_peak`` (PyTorch path) and their ratio, and the planner's line for the fused TileLang path
(not measurable here). The JSON line's target: every ratio within 10 %.

Usage: .venv/bin/python bench/dsa_peak.py [--cases 32768,8 32768,1 131072,8 131072,1]
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=["32768,8", "32768,1", "131072,8", "131072,1"])
    a = ap.parse_args()

    from glm5_mcore.config import glm5_744b
    from glm5_mcore.mcore_settings import ParallelConfig
    from glm5_mcore.model.parallel import init_parallel
    from glm5_mcore.plan.activations import dsa_core_peak
    from glm5_mcore.plan.layout import Layout
    from glm5_mcore.probes.dsa_peak import build_core, measure_core_peak

    init_parallel(ParallelConfig())
    m = glm5_744b()
    core = build_core(m)
    rows = []
    print(f"{'tokens':>7} {'TP':>3} {'measured GiB':>13} {'(phase)':>10} {'kept GiB':>9} {'planned GiB':>12} "
          f"{'planned/measured':>17} {'fused planned':>14} {'s':>6}")
    for case in a.cases:
        T, tp = map(int, case.split(","))
        t0 = time.perf_counter()
        r = measure_core_peak(m, T, tp, core)
        L = Layout(world=tp, tp=tp)
        planned, fused = dsa_core_peak(m, L, T, 2, fused=False), dsa_core_peak(m, L, T, 2, fused=True)
        dt = time.perf_counter() - t0
        rows.append({"tokens": T, "tp": tp, "measured_gib": round(r["peak"] / GIB, 3), "phase": r["phase"],
                     "forward_peak_gib": round(r["forward_peak"] / GIB, 3), "kept_gib": round(r["held"] / GIB, 3),
                     "planned_gib": round(planned / GIB, 3), "ratio": round(planned / r["peak"], 4),
                     "fused_planned_gib": round(fused / GIB, 3)})
        print(f"{T:>7} {tp:>3} {r['peak'] / GIB:>13.3f} {r['phase']:>10} {r['held'] / GIB:>9.3f} {planned / GIB:>12.3f} "
              f"{planned / r['peak']:>17.3f} {fused / GIB:>14.3f} {dt:>6.1f}", flush=True)
    ok = all(abs(x["ratio"] - 1) <= 0.10 for x in rows)
    print(json.dumps({"bench": "dsa_peak", "cases": rows, "target": "planned/measured within 0.90-1.10",
                      "target_met": ok}))


if __name__ == "__main__":
    main()

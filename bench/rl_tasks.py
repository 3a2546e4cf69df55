"""Reward throughput and sandbox cost (issue 31), measured side by side in one run.

1. ``reward.fn=math`` (math-verify) on a batch of ``--samples`` generated answer strings (``\\boxed{}`` and
   GSM8K ``####`` forms, right and wrong): samples/s scored in the driver (``reward.num_workers=0``, this
   thread) vs in the process pool (``--workers`` processes, ``rl.tasks.proc_pool``; started and warmed before
   timing), the same strings in ABAB order, best of ``--repeats``; the pool's scores must equal the
   driver's. Target: the pool at least as fast as the driver with >= 2 free cores (it buys isolation
   and signal timeouts at no cost); on a loaded machine the ratio says what the cores allowed.
2. The sandbox (``rl.tasks.sandbox.run_python``: bubblewrap, a cgroup and a uid per call): median and p90 ms
   of ``--calls`` calls of ``print(1)``, and of the code tool end to end (``rl.tasks.code_env.python_tool``:
   parse the GLM-5 tool call, run, describe). With ``--baseline REV`` the sandbox of that git revision
   (``git show REV:rl/tasks/sandbox.py``, e.g. the ``unshare`` one before issue 42) runs the same calls
   interleaved with today's (ABAB), so the per-call overhead of both is measured side by side, under the
   same load.

Usage: .venv/bin/python bench/rl_tasks.py [--samples 1000] [--workers 2] [--repeats 2] [--calls 20]
       [--baseline REV]
Ends with one JSON line of figures and targets.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")


def answer_strings(n: int, seed: int = 0) -> list[tuple[str, str]]:
    """(response, ground truth) pairs: boxed / #### / prose answers, ~half right."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        gt = rng.choice([str(rng.randint(-50, 500)), f"\\frac{{{rng.randint(1, 9)}}}{{{rng.randint(2, 9)}}}",
                         f"{rng.randint(0, 99)}.5"])
        pred = gt if rng.random() < 0.5 else str(rng.randint(-50, 500))
        form = i % 4
        text = [f"Step by step ... so the answer is \\boxed{{{pred}}}.", f"We compute it.\n#### {pred}",
                f"The final answer is ${pred}$", f"First 3, then 4, finally {pred}"][form]
        out.append((text, gt))
    return out


def baseline_sandbox(rev: str, folder: str):
    """``rl/tasks/sandbox.py`` as of git revision ``rev``, imported from a copy in ``folder`` (it runs its
    own file as the boot process, so the copy stays there while it is used)."""
    repo = Path(__file__).resolve().parents[1]
    src = subprocess.run(["git", "-C", str(repo), "show", f"{rev}:rl/tasks/sandbox.py"], capture_output=True,
                         text=True, check=True).stdout
    path = Path(folder) / "sandbox_baseline.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("sandbox_baseline", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--samples", type=int, default=1000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--baseline", default=None, help="git revision whose sandbox runs beside today's")
    p.add_argument("--skip-reward", action="store_true", help="only the sandbox")
    a = p.parse_args()

    from rl.tasks.code_env import python_tool
    from rl.config import RewardCfg
    from rl.tasks.rewards import RewardScorer
    from rl.tasks.sandbox import isolation, run_python

    figures = {}
    if not a.skip_reward:
        figures.update(reward_bench(a, RewardCfg, RewardScorer))
    iso = isolation()
    print(f"sandbox: {iso.line}")
    q = lambda v, f: sorted(v)[min(len(v) - 1, int(f * len(v)))]  # noqa: E731
    call = "<tool_call>python<arg_key>code</arg_key><arg_value>print(sum(range(10)))</arg_value></tool_call>"
    with tempfile.TemporaryDirectory() as tmp:
        old = baseline_sandbox(a.baseline, tmp) if a.baseline else None
        raw, tool, base = [], [], []
        load0 = os.getloadavg()
        run_python("print(1)")  # the first call of a process finds the tools and the interpreter's files
        if old is not None:
            old.run_python("print(1)")
        for _ in range(a.calls):
            t0 = time.perf_counter()
            r = run_python("print(1)")
            raw.append((time.perf_counter() - t0) * 1e3)
            assert r.status == "ok" and r.stdout == "1\n", r
            if old is not None:
                t0 = time.perf_counter()
                r = old.run_python("print(1)")
                base.append((time.perf_counter() - t0) * 1e3)
                assert r.status == "ok" and r.stdout == "1\n", r
            t0 = time.perf_counter()
            assert python_tool("", call) == "45"
            tool.append((time.perf_counter() - t0) * 1e3)
        load1 = os.getloadavg()
    med = statistics.median
    print(f"{a.calls} calls of print(1), load {load0[0]:.2f} -> {load1[0]:.2f}: run_python median {med(raw):.0f} ms "
          f"(p90 {q(raw, 0.9):.0f}); code tool median {med(tool):.0f} ms (p90 {q(tool, 0.9):.0f})")
    if base:
        print(f"  baseline {a.baseline} (interleaved): median {med(base):.0f} ms (p90 {q(base, 0.9):.0f}); "
              f"today / baseline {med(raw) / med(base):.2f}x")
        figures.update({"baseline": a.baseline, "baseline_call_median_ms": round(med(base), 1),
                        "baseline_call_p90_ms": round(q(base, 0.9), 1),
                        "call_median_vs_baseline": round(med(raw) / med(base), 3)})
    figures.update({"sandbox_call_median_ms": round(med(raw), 1), "sandbox_call_p90_ms": round(q(raw, 0.9), 1),
                    "code_tool_call_median_ms": round(med(tool), 1), "sandbox_isolated": iso.ok,
                    "cores": os.cpu_count(), "sandbox_loadavg": [round(load0[0], 2), round(load1[0], 2)]})
    ok = iso.ok and med(raw) <= 500 and figures.get("reward_pool_vs_inline", 1.0) >= 1.0
    print(json.dumps({**figures, "targets": {"reward_pool_vs_inline_ge": 1.0, "sandbox_call_median_ms_le": 500},
                      "pass": ok}))


def reward_bench(a, RewardCfg, RewardScorer) -> dict:
    """Part 1 (the module docstring): samples/s of math-verify in the driver and in the pool."""
    pairs = answer_strings(a.samples)
    args = (["openai/gsm8k"] * len(pairs), [s for s, _ in pairs], [g for _, g in pairs], [{}] * len(pairs))
    inline = RewardScorer(RewardCfg(fn="math", num_workers=0))
    pool = RewardScorer(RewardCfg(fn="math", num_workers=a.workers, timeout_s=60))
    inline.score(*(x[:20] for x in args))  # imports math-verify here
    pool.score(*(x[:4 * a.workers] for x in args))  # every worker started and warm
    times = {"inline": [], "pool": []}
    scores = {}
    load0 = os.getloadavg()
    try:
        for _ in range(a.repeats):
            for name, sc in (("inline", inline), ("pool", pool)):
                t0 = time.perf_counter()
                scores[name], counts, _ = sc.score(*args)
                times[name].append(time.perf_counter() - t0)
    finally:
        pool.close()
    load1 = os.getloadavg()
    assert scores["pool"] == scores["inline"], "the pool scored differently from the driver"
    rate = {k: len(pairs) / min(v) for k, v in times.items()}
    ratio = rate["pool"] / rate["inline"]
    print(f"reward.fn=math on {len(pairs)} samples ({sum(scores['pool']):.0f} right), best of {a.repeats}, "
          f"{os.cpu_count()} cores, load {load0[0]:.2f} -> {load1[0]:.2f}:")
    print(f"  in the driver      {rate['inline']:8.1f} samples/s")
    print(f"  pool of {a.workers} workers  {rate['pool']:8.1f} samples/s  ({ratio:.2f}x)")
    return {"reward_samples": len(pairs), "reward_inline_samples_per_s": round(rate["inline"], 1),
            "reward_pool_samples_per_s": round(rate["pool"], 1), "reward_pool_workers": a.workers,
            "reward_pool_vs_inline": round(ratio, 3), "loadavg": [round(load0[0], 2), round(load1[0], 2)]}


if __name__ == "__main__":
    main()

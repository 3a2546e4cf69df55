"""Pretraining-scale data: ``glm5 data preprocess`` throughput, and the training loader from indexed
data vs the jsonl path (throughput and peak RSS), side by side in one run.

A synthetic corpus (≥ 100 MB of jsonl: 80 % ``{"text"}`` rows, 10 % prompt/response, 10 % chats;
word-level tokenizer over a 50 000-word vocabulary, as ``glm5 tiny`` writes) is generated under a
temporary folder (made fresh inside ``--workdir`` if given, removed at the end unless ``--keep``):
- tokens/s of a single-process tokenizer baseline (``glm5_mcore.data.sft.parse_line`` over every row, the
  recipe's own tokenization, nothing written) vs ``preprocess`` with 1 and 2 worker processes
  (tokenize + write the indexed dataset + merge);
- the training loader (a fresh process each, ``data.micro_batch_tokens=8192``, 8 micro-batches a
  step): from indexed data (``glm5_mcore.data.indexed.IndexedData``: build the blend, plan, read the
  step's documents, pack) vs the jsonl path (``read_jsonl`` + ``pack`` of an epoch, as ``glm5 sft``
  does at start): start-up seconds and tokens/s over the same number of steps;
- peak RSS of each loader at two corpus sizes: indexed at 1x and 4x the corpus (the 4x dataset is
  the 1x one concatenated four times with Megatron's ``IndexedDatasetBuilder.add_index``), jsonl at
  a 1/10 and a 2/10 slice (it holds every document in memory).
Targets: 2 workers ≥ 1.5x the 1-worker rate (2 cores; on a machine shared with other jobs the wall-clock
ratio is noise, so the CPU seconds of main process and workers are reported too, with the ratio an idle
2-core machine would give); indexed loader RSS at 4x ≤ 1.1x its RSS at 1x; the indexed loader's
tokens/s over the run ≥ the jsonl path's.

Usage: .venv/bin/python bench/data_preprocess.py [--mb 100] [--workdir DIR] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MICRO, ACCUM, MAX_TOKENS = 8192, 8, 2048


def _corpus(path: Path, mb: float, seed: int = 0) -> int:
    """``mb`` MB of jsonl rows; returns the row count."""
    r = random.Random(seed)
    vocab = [f"w{i}" for i in range(49_000)]
    rows, size, target = 0, 0, int(mb * (1 << 20))
    with open(path, "w") as f:
        while size < target:
            kind = r.random()
            if kind < 0.8:
                row = {"text": " ".join(r.choices(vocab, k=int(r.paretovariate(1.5) * 120)))}
            elif kind < 0.9:
                row = {"prompt": " ".join(r.choices(vocab, k=r.randrange(10, 200))),
                       "response": " ".join(r.choices(vocab, k=r.randrange(10, 300)))}
            else:
                row = {"messages": [{"role": "user", "content": " ".join(r.choices(vocab, k=40))},
                                    {"role": "assistant", "content": " ".join(r.choices(vocab, k=80))}]}
            line = json.dumps(row) + "\n"
            f.write(line)
            size += len(line)
            rows += 1
    return rows


def _cpu() -> tuple[float, float]:
    """(CPU seconds of this process, of its reaped children)."""
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


def _baseline(path: Path, tok_dir: Path) -> dict:
    from transformers import AutoTokenizer

    from glm5_mcore.data.sft import parse_line

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    t0, tokens = time.perf_counter(), 0
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            tokens += len(parse_line(line, tok, f"{path}:{n}").tokens)
    dt = time.perf_counter() - t0
    return {"tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt}


def _concat(src: Path, out: Path, times: int) -> None:
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, IndexedDataset

    out.mkdir()
    for name in ("tokens", "loss_mask"):
        dtype = IndexedDataset(str(src / name)).index.dtype
        b = IndexedDatasetBuilder(str(out / f"{name}.bin"), dtype=np.dtype(dtype).type)
        for _ in range(times):
            b.add_index(str(src / name))
        b.finalize(str(out / f"{name}.idx"))


def _rss_mb() -> float:
    """Resident set size now (MB): anonymous memory + mapped file pages (the .idx files touched)."""
    import psutil

    return psutil.Process().memory_info().rss / (1 << 20)


def _rss_anon_mb() -> float:
    """Anonymous resident memory now (MB): what the loader allocates, no file pages."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _loader(kind: str, data: str, tok_dir: str, steps: int, cache: str) -> dict:
    """One loader in this process: start-up, ``steps`` steps of batches, peak RSS."""
    from glm5_mcore.data.order import epoch_order
    from glm5_mcore.data.sft import pack, read_jsonl
    from recipes.sft import DataCfg

    import glm5_mcore.data.indexed  # noqa: F401  (imports before the RSS baseline)
    import megatron.core.datasets.blended_megatron_dataset_builder  # noqa: F401
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    rss0, anon0 = peak, peak_anon = _rss_mb(), _rss_anon_mb()
    cfg = DataCfg(train=data, micro_batch_tokens=MICRO, global_batch_tokens=MICRO * ACCUM, max_tokens=MAX_TOKENS)
    t0 = time.perf_counter()
    tokens = 0
    if kind == "indexed":
        from glm5_mcore.data.indexed import IndexedData

        d = IndexedData(cfg, steps, ACCUM, 1, 0, 1, 0, cache)
        t_start = time.perf_counter() - t0
        sample = 0
        for _ in range(steps):
            batches, n, sample = d.step(sample)
            tokens += sum(b.num_tokens for b in batches)
            peak, peak_anon = max(peak, _rss_mb()), max(peak_anon, _rss_anon_mb())
    else:
        docs = read_jsonl(data, tok, MAX_TOKENS)
        packs = pack([docs[i] for i in epoch_order(len(docs), cfg.seed, 0)], MICRO)
        t_start = time.perf_counter() - t0
        for s in range(steps):
            tokens += sum(b.num_tokens for b in packs[(s * ACCUM) % len(packs):][:ACCUM])
            peak, peak_anon = max(peak, _rss_mb()), max(peak_anon, _rss_anon_mb())
    dt = time.perf_counter() - t0
    return {"startup_s": round(t_start, 3), "seconds": round(dt, 3), "tokens": tokens,
            "tokens_per_s": round(tokens / dt, 1), "steady_tokens_per_s": round(tokens / max(dt - t_start, 1e-9), 1),
            "rss_before_mb": round(rss0, 1), "peak_rss_mb": round(max(peak, _rss_mb()), 1),
            "loader_rss_mb": round(max(peak, _rss_mb()) - rss0, 1),
            "loader_rss_anon_mb": round(max(peak_anon, _rss_anon_mb()) - anon0, 1)}


def _run_loader(kind: str, data: Path, tok_dir: Path, steps: int, cache: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(Path(__file__).resolve().parent.parent))
    r = subprocess.run([sys.executable, __file__, "--loader", kind, str(data), str(tok_dir), str(steps), str(cache)],
                       capture_output=True, text=True, env=env, timeout=3600)
    if r.returncode:
        raise RuntimeError(r.stderr[-3000:])
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=float, default=100.0)
    ap.add_argument("--steps", type=int, default=40, help="loader steps (of MICRO x ACCUM tokens)")
    ap.add_argument("--workdir")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--loader", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.loader:
        kind, data, tok_dir, steps, cache = a.loader
        print(json.dumps(_loader(kind, data, tok_dir, int(steps), cache)))
        return

    from glm5_mcore.tiny import write_tokenizer
    from glm5_mcore.data.preprocess import preprocess

    if a.workdir:
        Path(a.workdir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="glm5-bench-data-", dir=a.workdir))  # only this folder is removed
    try:
        tok_dir = work / "tokenizer"
        tok_dir.mkdir(exist_ok=True)
        write_tokenizer(tok_dir, 50_000)
        corpus = work / "corpus.jsonl"
        t0 = time.perf_counter()
        rows = _corpus(corpus, a.mb)
        mb = corpus.stat().st_size / (1 << 20)
        print(f"corpus: {rows} rows, {mb:.1f} MB ({time.perf_counter() - t0:.1f} s to generate)", flush=True)

        c0 = _cpu()
        base = _baseline(corpus, tok_dir)
        base["cpu_s"] = _cpu()[0] - c0[0]
        print(f"baseline (1 process, tokenize only): {base['tokens_per_s'] / 1e6:.2f} M tok/s", flush=True)
        pre = {}
        for w in (1, 2):
            c0 = _cpu()
            out = preprocess([corpus], work / f"idx_w{w}", tok_dir, workers=w, progress=False)
            c1 = _cpu()
            out["main_cpu_s"], out["worker_cpu_s"] = c1[0] - c0[0], c1[1] - c0[1]
            pre[w] = out
            print(f"preprocess --workers {w}: {out['tokens_per_s'] / 1e6:.2f} M tok/s "
                  f"({out['seconds']:.1f} s, {out['documents']} documents, {out['tokens']} tokens)", flush=True)
        same = all((work / "idx_w1" / f).read_bytes() == (work / "idx_w2" / f).read_bytes()
                   for f in ("tokens.bin", "tokens.idx", "loss_mask.bin", "loss_mask.idx"))
        assert base["tokens"] == pre[1]["tokens"] == pre[2]["tokens"] and same

        _concat(work / "idx_w1", work / "idx_x4", 4)
        lines = corpus.read_text().splitlines(keepends=True)
        for frac in (1, 2):
            (work / f"slice{frac}.jsonl").write_text("".join(lines[: len(lines) * frac // 10]))
        del lines
        loaders = {
            "indexed_1x": _run_loader("indexed", work / "idx_w1", tok_dir, a.steps, work / "cache1"),
            "indexed_4x": _run_loader("indexed", work / "idx_x4", tok_dir, a.steps, work / "cache4"),
            "jsonl_slice1": _run_loader("jsonl", work / "slice1.jsonl", tok_dir, a.steps, work / "c"),
            "jsonl_slice2": _run_loader("jsonl", work / "slice2.jsonl", tok_dir, a.steps, work / "c"),
        }
        for k, v in loaders.items():
            print(f"loader {k}: start-up {v['startup_s']:.2f} s, {v['tokens_per_s'] / 1e6:.2f} M tok/s over "
                  f"{a.steps} steps (steady {v['steady_tokens_per_s'] / 1e6:.2f}), peak RSS {v['peak_rss_mb']:.0f} MB "
                  f"(before loading {v['rss_before_mb']:.0f}; loader +{v['loader_rss_mb']:.0f}, "
                  f"anonymous +{v['loader_rss_anon_mb']:.0f})", flush=True)
        ix1, ix4, j1, j2 = (loaders[k] for k in ("indexed_1x", "indexed_4x", "jsonl_slice1", "jsonl_slice2"))
        res = {
            "corpus_mb": round(mb, 1), "tokens": pre[1]["tokens"], "documents": pre[1]["documents"],
            "baseline_tokens_per_s": round(base["tokens_per_s"], 1),
            "preprocess_w1_tokens_per_s": pre[1]["tokens_per_s"], "preprocess_w2_tokens_per_s": pre[2]["tokens_per_s"],
            "w1_over_baseline": round(pre[1]["tokens_per_s"] / base["tokens_per_s"], 3),
            "w2_over_baseline": round(pre[2]["tokens_per_s"] / base["tokens_per_s"], 3),
            "w2_over_w1": round(pre[2]["tokens_per_s"] / pre[1]["tokens_per_s"], 3),
            "outputs_identical_w1_w2": same,
            # CPU seconds (independent of how busy the machine is): the work per token, and the 2-worker
            # wall time an idle 2-core machine would give (main process serial + workers' CPU / 2)
            "baseline_cpu_s": round(base["cpu_s"], 1), "w1_cpu_s": round(pre[1]["main_cpu_s"], 1),
            "w2_main_cpu_s": round(pre[2]["main_cpu_s"], 1), "w2_worker_cpu_s": round(pre[2]["worker_cpu_s"], 1),
            "w2_over_w1_idle_projection": round(pre[1]["main_cpu_s"] / (pre[2]["main_cpu_s"]
                                                                        + pre[2]["worker_cpu_s"] / 2), 3),
            "loader_indexed_tokens_per_s": ix1["tokens_per_s"], "loader_jsonl_tokens_per_s": j1["tokens_per_s"],
            "loader_indexed_startup_s": ix1["startup_s"], "loader_jsonl_startup_s": j1["startup_s"],
            "loader_indexed_over_jsonl": round(ix1["tokens_per_s"] / j1["tokens_per_s"], 3),
            "indexed_peak_rss_mb_1x": ix1["peak_rss_mb"], "indexed_peak_rss_mb_4x": ix4["peak_rss_mb"],
            "indexed_rss_4x_over_1x": round(ix4["peak_rss_mb"] / ix1["peak_rss_mb"], 3),
            "jsonl_peak_rss_mb_slice1": j1["peak_rss_mb"], "jsonl_peak_rss_mb_slice2": j2["peak_rss_mb"],
            "jsonl_rss_2x_over_1x": round(j2["peak_rss_mb"] / j1["peak_rss_mb"], 3),
            "indexed_loader_rss_mb_1x": ix1["loader_rss_mb"], "indexed_loader_rss_mb_4x": ix4["loader_rss_mb"],
            "jsonl_loader_rss_mb_slice1": j1["loader_rss_mb"], "jsonl_loader_rss_mb_slice2": j2["loader_rss_mb"],
            "indexed_loader_rss_anon_mb_1x": ix1["loader_rss_anon_mb"],
            "indexed_loader_rss_anon_mb_4x": ix4["loader_rss_anon_mb"],
            "cpus": os.cpu_count(), "load_avg_1min_at_end": round(os.getloadavg()[0], 2),
            "targets": {"w2_over_w1": 1.5, "indexed_rss_4x_over_1x_max": 1.1, "loader_indexed_over_jsonl": 1.0},
        }
        res["pass"] = (res["w2_over_w1"] >= 1.5 and res["indexed_rss_4x_over_1x"] <= 1.1
                       and res["loader_indexed_over_jsonl"] >= 1.0)
        print(json.dumps(res))
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()

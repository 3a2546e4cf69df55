"""``glm5 data preprocess``: jsonl rows → a Megatron-Core indexed dataset, tokenized once.

Output: a folder ``OUT/`` holding
- ``tokens.bin`` / ``tokens.idx``: Megatron-Core's ``IndexedDataset`` (one sequence per document,
  uint16 or int32 by vocabulary size) — the prefix ``OUT/tokens`` is what Megatron-LM's own
  ``GPTDataset`` reads too;
- ``loss_mask.bin`` / ``loss_mask.idx``: a second ``IndexedDataset`` (uint8), the same lengths,
  1 where the token is a training target (prompt / non-assistant tokens 0). Written only when
  some document has a masked token; absent = every token trains (plain pretraining text);
- ``summary.json``: documents, tokens, truncated, skipped (+ the first errors), inputs, tokenizer.

Rows are parsed by the recipe's own ``glm5_mcore.data.sft.parse_line`` (every row kind, same masks, same
errors), cut by ``glm5_mcore.data.sft.truncate``. The inputs are cut into byte ranges at line boundaries;
worker processes (forked, so they start at once) each tokenize a range into a part dataset, and the
parts are merged in input order into one ``IndexedDatasetBuilder`` (as its ``add_index`` does), so the
output does not depend on the worker count. A bad row stops the run with ``file:line`` (or is skipped and counted with ``skip_bad_rows``);
everything is built under a temporary sibling folder and renamed into place at the end, so a
failed run leaves a previous output byte-identical.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from glm5_mcore.checkpoint.atomic import atomic_dir
from glm5_mcore.data.sft import DataError, parse_line, truncate

FORMAT = "glm5-indexed-v1"
TOKENS, MASK = "tokens", "loss_mask"
MAX_ERRORS = 20


@dataclass
class Summary:
    rows: int = 0
    documents: int = 0
    tokens: int = 0
    truncated: int = 0
    skipped: int = 0
    masked_tokens: int = 0
    errors: list[str] = field(default_factory=list)

    def add(self, o: "Summary") -> None:
        for k in ("rows", "documents", "tokens", "truncated", "skipped", "masked_tokens"):
            setattr(self, k, getattr(self, k) + getattr(o, k))
        self.errors += o.errors[: MAX_ERRORS - len(self.errors)]


@dataclass
class _Task:
    path: str
    start: int  # byte range [start, end) at line boundaries
    end: int
    first_line: int
    part: str  # output prefix of this range's part dataset
    max_tokens: int
    skip_bad_rows: bool
    dtype: str


_TOKENIZER = None


def _init_worker(hf_dir: str) -> None:
    global _TOKENIZER
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers import AutoTokenizer

    _TOKENIZER = AutoTokenizer.from_pretrained(hf_dir)


def _encode_range(task: _Task) -> tuple[Summary, Optional[np.ndarray], Optional[str]]:
    """Tokenize one byte range into ``task.part``.bin (tokens) and ``_mask.bin`` (uint8), raw token
    arrays back to back as in an ``IndexedDataset`` .bin; (its summary, the document lengths
    int32 [docs], the first fatal error or None). Imports no Megatron (a worker starts in seconds)."""
    s = Summary()
    with open(task.path, "rb") as f:
        f.seek(task.start)
        data = f.read(task.end - task.start)
    lengths = []
    with open(task.part + ".bin", "wb") as toks, open(task.part + "_mask.bin", "wb") as masks:
        for n, raw in enumerate(data.split(b"\n"), task.first_line):
            if not raw.strip():
                continue
            where = f"{task.path}:{n}"
            s.rows += 1
            try:
                doc = parse_line(raw, _TOKENIZER, where, task.max_tokens)
            except DataError as e:
                if not task.skip_bad_rows:
                    return s, None, str(e)
                s.skipped += 1
                if len(s.errors) < MAX_ERRORS:
                    s.errors.append(str(e))
                continue
            doc, cut = truncate(doc, task.max_tokens)
            s.truncated += cut
            m = np.asarray(doc.mask, dtype=np.uint8)
            toks.write(np.asarray(doc.tokens, dtype=task.dtype).tobytes())
            masks.write(m.tobytes())
            lengths.append(m.size)
            s.documents += 1
            s.tokens += m.size
            s.masked_tokens += int(m.size - m.sum())
    return s, np.asarray(lengths, dtype=np.int32), None


def _merge(tmp: Path, name: str, suffix: str, dtype: str, parts: list[tuple[str, np.ndarray]]) -> None:
    """``tmp/name``.{bin,idx}: the parts in order, one document per sequence. What
    ``IndexedDatasetBuilder.add_index`` does, fed with the lengths the workers returned."""
    import shutil

    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(str(tmp / f"{name}.bin"), dtype=np.dtype(dtype).type)
    for part, lengths in parts:
        with open(part + suffix + ".bin", "rb") as f:
            shutil.copyfileobj(f, builder.data_file, 1 << 22)
        n = len(builder.sequence_lengths)
        builder.sequence_lengths.extend(lengths.tolist())
        builder.document_indices.extend(range(n + 1, n + len(lengths) + 1))
    builder.finalize(str(tmp / f"{name}.idx"))


def _ranges(path: Path, chunk_bytes: int) -> list[tuple[int, int, int]]:
    """(start, end, first line number) of ~``chunk_bytes`` ranges of ``path`` cut after newlines."""
    size = path.stat().st_size
    cuts = [0]
    with open(path, "rb") as f:
        while cuts[-1] < size:
            f.seek(min(cuts[-1] + chunk_bytes, size))
            if f.tell() < size:
                f.readline()
            cuts.append(min(f.tell(), size))
        out, line = [], 1
        for a, b in zip(cuts[:-1], cuts[1:]):
            out.append((a, b, line))
            f.seek(a)
            left = b - a
            while left:
                block = f.read(min(left, 1 << 24))
                line += block.count(b"\n")
                left -= len(block)
    return out


def _check_paths(inputs: list[Path], out: Path) -> None:
    for p in inputs:
        if not p.is_file():
            raise FileNotFoundError(f"{p}: input file does not exist")
        if out.resolve() == p.resolve() or out.resolve() in p.resolve().parents:
            raise ValueError(f"{out}: the output folder would contain or replace the input {p}")
    if out.exists():
        marker = out / "summary.json"
        ours = False
        if out.is_dir() and marker.is_file():
            try:
                ours = json.loads(marker.read_text()).get("format") == FORMAT
            except (ValueError, OSError):
                ours = False
        if not ours and not (out.is_dir() and not any(out.iterdir())):
            raise ValueError(f"{out}: exists and is not a glm5 data preprocess output; refusing to replace it")


def preprocess(inputs: list[str | Path], out: str | Path, hf_dir: str | Path, workers: int = 1,
               max_tokens: Optional[int] = None, skip_bad_rows: bool = False, chunk_mb: float = 8.0,
               progress: bool = True) -> dict:
    """Tokenize the jsonl ``inputs`` (in order) into the indexed dataset folder ``out`` with
    ``workers`` processes; returns the summary (also written to ``out/summary.json``)."""
    from multiprocessing import get_all_start_methods, get_context

    from megatron.core.datasets.indexed_dataset import DType
    from transformers import AutoTokenizer

    inputs, out = [Path(p) for p in inputs], Path(out)
    if not inputs:
        raise ValueError("--input: no input files given")
    for p in inputs:
        if p.suffix not in (".jsonl", ".json"):
            raise ValueError(f"{p}: expected a .jsonl file (parquet needs pyarrow, which is not installed)")
    _check_paths(inputs, out)
    if workers < 1:
        raise ValueError(f"--workers {workers}: must be >= 1")
    tokenizer = AutoTokenizer.from_pretrained(str(hf_dir))
    dtype = np.dtype(DType.optimal_dtype(len(tokenizer))).name
    max_tokens = max_tokens if max_tokens is not None else (1 << 31) - 2
    if max_tokens < 1:
        raise ValueError(f"--max-tokens {max_tokens}: must be >= 1")
    plan = [(p, r) for p in inputs for r in _ranges(p, max(1, int(chunk_mb * (1 << 20))))]
    total_bytes = sum(p.stat().st_size for p in inputs)
    t0 = time.perf_counter()
    summary = Summary()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # fork where there is one: workers start with this process's imports (torch, transformers) at once;
    # made before the progress bar's monitor thread exists
    ctx = get_context("fork" if "fork" in get_all_start_methods() else "spawn")
    pool = ctx.Pool(workers, _init_worker, (str(hf_dir),)) if workers > 1 else None
    bar = None
    try:
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc="preprocess", dynamic_ncols=True)
        with atomic_dir(out) as tmp:
            parts = tmp / "parts"
            parts.mkdir()
            tasks = [_Task(str(p), a, b, line, str(parts / f"{i:06d}"), max_tokens, skip_bad_rows, dtype)
                     for i, (p, (a, b, line)) in enumerate(plan)]
            if pool is None:
                _init_worker(str(hf_dir))
            results = pool.imap(_encode_range, tasks) if pool else map(_encode_range, tasks)
            done = []
            for task, (s, lengths, err) in zip(tasks, results):
                if err is not None:
                    raise DataError(err)
                summary.add(s)
                done.append((task.part, lengths))
                if bar is not None:
                    bar.update(task.end - task.start)
            if summary.documents == 0:
                raise DataError(f"{inputs[0]}: no usable rows ({summary.skipped} skipped)")
            _merge(tmp, TOKENS, "", dtype, done)
            if summary.masked_tokens:
                _merge(tmp, MASK, "_mask", "uint8", done)
            for f in parts.iterdir():
                f.unlink()
            parts.rmdir()
            dt = time.perf_counter() - t0
            result = {"format": FORMAT, **asdict(summary), "loss_mask": bool(summary.masked_tokens),
                      "dtype": dtype, "inputs": [str(p) for p in inputs], "tokenizer": str(hf_dir),
                      "max_tokens": max_tokens, "workers": workers, "seconds": round(dt, 3),
                      "tokens_per_s": round(summary.tokens / dt, 1)}
            (tmp / "summary.json").write_text(json.dumps(result, indent=1) + "\n")
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        if bar is not None:
            bar.close()
    return result

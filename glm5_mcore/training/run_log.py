"""Where a run's per-step metrics go: the W&B run (offline unless a project is given) and
``RUN/metrics.jsonl`` in the run's own folder — one place, used by the SFT recipe and the RL driver.

``metrics.jsonl`` holds one JSON object per logged step, ``{"step": N, <metric>: value, ...}``, with
the names W&B gets (scalars only; a non-finite value is written as ``null``), so a run has curves
without a W&B account (``glm5 plot RUN``). A resumed run continues the file: rows of steps after
the checkpoint it resumed from (logged by the interrupted run, then redone) are dropped first, so
the file always describes the run as it now stands, each step once. A step-0 row carries the
evaluation before training (``val_loss`` / ``val/reward``).

``RunLogger`` is a run's logger for both recipes: the sinks (``RunLog``) + a console progress bar
showing the recipe's ``console_keys``, on the reporting process only.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from pathlib import Path
from typing import Optional

from tqdm import tqdm

from glm5_mcore.training import loop
from glm5_mcore.checkpoint.atomic import atomic_write_text
from glm5_mcore.data.jsonl import decode_json_line

METRICS_FILE = "metrics.jsonl"


def scalars(metrics: dict) -> dict:
    """The numeric entries of ``metrics`` as Python floats / ints / bools (what W&B and the file get)."""
    out = {}
    for k, v in metrics.items():
        if isinstance(v, bool):
            out[k] = v
        elif isinstance(v, numbers.Integral):
            out[k] = int(v)
        elif isinstance(v, numbers.Real):
            out[k] = float(v)
    return out


def read_metrics(path: str | Path) -> list[dict]:
    """The rows of a ``metrics.jsonl`` (a torn last line, from a run killed mid-write, is left out);
    a malformed row elsewhere is a ``ValueError`` naming ``file:line``."""
    path = Path(path)
    lines = path.read_bytes().split(b"\n")
    rows = []
    for n, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        torn = n == len(lines)  # no newline after it: the writer was interrupted
        try:
            row = decode_json_line(raw, f"{path}:{n}")
        except ValueError:
            if torn:
                break
            raise
        if not isinstance(row, dict) or not isinstance(row.get("step"), int):
            raise ValueError(f"{path}:{n}: expected an object with an integer 'step'")
        rows.append(row)
    return rows


class MetricsFile:
    """``out/metrics.jsonl``, appended one line per step (flushed), continued after ``start_step``."""

    def __init__(self, out: str | Path, start_step: int = 0):
        self.path = Path(out) / METRICS_FILE
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.path.exists():
            self._keep_until(start_step)
        self.f = open(self.path, "a", encoding="utf-8")

    def _keep_until(self, start_step: int) -> None:
        """Drop the rows of steps after ``start_step`` (all rows on a fresh start), in one rename."""
        rows = []
        for raw in self.path.read_bytes().split(b"\n"):  # our own file: a torn or damaged line is dropped
            try:
                row = json.loads(raw)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int):
                rows.append(row)
        text = "".join(_line(r) for r in rows if start_step > 0 and r["step"] <= start_step)
        if self.path.read_text(encoding="utf-8", errors="replace") != text:
            atomic_write_text(self.path, text)

    def write(self, step: int, metrics: dict) -> None:
        self.f.write(_line({"step": int(step), **scalars(metrics)}))
        self.f.flush()

    def close(self) -> None:
        if not self.f.closed:
            self.f.flush()
            os.fsync(self.f.fileno())
            self.f.close()


def _line(row: dict) -> str:
    clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in row.items()}
    return json.dumps(clean, allow_nan=False) + "\n"


class RunLog:
    """A run's metrics sink: ``log(step, metrics)`` goes to W&B and to ``out/metrics.jsonl``."""

    def __init__(self, wandb_cfg, out: str | Path, config: dict, start_step: int = 0):
        self.file: Optional[MetricsFile] = MetricsFile(out, start_step)
        self.run = loop.init_wandb(wandb_cfg, str(out), config)

    def log(self, step: int, metrics: dict) -> dict:
        """Record ``metrics`` of ``step``; returns their scalar part."""
        values = scalars(metrics)
        if self.run is not None:
            self.run.log(values, step=step)
        self.file.write(step, values)
        return values

    def close(self) -> None:
        self.file.close()
        if self.run is not None:
            self.run.finish()


class RunLogger:
    """A run's metrics (``RunLog``: W&B + ``out/metrics.jsonl``) and a console progress bar over ``steps``
    (``progress``) whose postfix shows ``console_keys`` (``(short name, metric key)`` pairs, formatted
    ``fmt``). ``active=False`` (a non-reporting rank) makes every call a no-op. ``history`` keeps every
    logged step's metrics, ``{"step": N, **metrics}``."""

    def __init__(self, wandb_cfg, out: str | Path, config: dict, *, steps: int, start_step: int = 0,
                 progress: bool = True, desc: str = "run", console_keys: tuple = (), fmt: str = ".3g",
                 active: bool = True):
        self.active = active
        self.console_keys = console_keys
        self.fmt = fmt
        self.history: list[dict] = []
        self.run: Optional[RunLog] = None
        self.bar = None
        if not active:
            return
        self.run = RunLog(wandb_cfg, out, config, start_step)
        if progress:
            self.bar = tqdm(total=steps, initial=start_step, desc=desc, dynamic_ncols=True)

    def log(self, step: int, metrics: dict) -> None:
        if not self.active:
            return
        self.history.append({"step": step, **metrics})
        values = self.run.log(step, metrics)
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix({short: format(values[k], self.fmt) for short, k in self.console_keys if k in values},
                                 refresh=True)

    def log_eval(self, step: int, metrics: dict) -> None:
        """An evaluation outside a training step (before the first one): the metrics sinks only."""
        if self.active:
            self.run.log(step, metrics)

    def note(self, text: str) -> None:
        """A line on the console that does not break the progress bar."""
        if not self.active:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.run is not None:
            self.run.close()

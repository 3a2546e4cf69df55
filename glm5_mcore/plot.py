"""``glm5 plot RUN_DIR [RUN_DIR ...] [--out FILE.png]``: a run's curves from its ``metrics.jsonl``
(``glm5_mcore.training.run_log``), no W&B account needed.

The panels are data (``PANELS``): a title and the metric names it draws (the names W&B gets). A
panel is drawn when at least one run has one of its metrics, so an SFT run gets the SFT panels, an RL
run the RL ones; several runs are overlaid, one colour per run folder (legend: folder name, plus the
metric where a panel has several, one line style each; a single run gets a colour per metric). Rendered with matplotlib's Agg canvas (no
display, no pyplot state). The PNG carries the text chunk ``glm5-output: plot``: ``--out`` replaces
only a PNG this command wrote (``atomic.check_output_file``), through a temporary file and a rename.
"""

from __future__ import annotations

import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from glm5_mcore.training.run_log import METRICS_FILE, read_metrics
from glm5_mcore.checkpoint.atomic import check_output_file, publish_file

KIND = "plot"
_MARK_KEY = "glm5-output"


@dataclass(frozen=True)
class Panel:
    title: str
    metrics: tuple[str, ...]
    symlog: float = 0.0
    """> 0: symmetric log scale, linear within ±symlog (metrics spanning orders of magnitude, some
    possibly 0 or negative, e.g. a KL estimate near 0 beside a masked fraction)."""


SFT_PANELS = (
    Panel("loss (train, val)", ("loss", "val_loss")),
    Panel("learning rate", ("lr",)),
    Panel("grad norm", ("grad_norm",)),
    Panel("tokens/s", ("tokens_per_s",)),
)
RL_PANELS = (
    Panel("reward (train, held-out)", ("critic/score/mean", "val/reward")),
    Panel("response length", ("response_length/mean",)),
    Panel("entropy", ("actor/entropy",)),
    Panel("KL", ("actor/ref_kl", "actor/ppo_kl", "rollout_corr/k3_kl")),
    Panel("IcePop (rollout vs trainer)", ("rollout_corr/kl", "rollout_corr/rollout_is_oob_ratio",
                                          "rollout_corr/logprob_abs_diff_mean"), symlog=1e-8),
    Panel("time per phase (s)", ("timing_s/gen", "timing_s/reward", "timing_s/old_log_prob",
                                 "timing_s/update_actor", "timing_s/weight_sync", "timing_s/step")),
)
PANELS = SFT_PANELS + RL_PANELS
HUGE_SPAN = 1e150
"""A panel whose values span more than this (e.g. a diverged loss at ±1e308, whose span overflows to inf)
is drawn on a symmetric log axis instead of failing inside matplotlib's linear autoscale."""


def load_runs(run_dirs: list[str | Path]) -> dict[str, list[dict]]:
    """{label: rows} for each run folder (label: the folder's name, made unique); a folder without
    ``metrics.jsonl`` is a ``ValueError`` naming it."""
    runs: dict[str, list[dict]] = {}
    for d in run_dirs:
        d = Path(d)
        path = d / METRICS_FILE
        if not path.is_file():
            why = "no such folder" if not d.exists() else f"no {METRICS_FILE} in it (not a glm5 sft / rl run folder?)"
            raise ValueError(f"{d}: {why}")
        rows = read_metrics(path)
        if not rows:
            raise ValueError(f"{path}: no metrics rows yet")
        label = d.resolve().name or str(d)
        while label in runs:
            label = f"{label}'"
        runs[label] = rows
    return runs


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], float(r[key])) for r in rows if isinstance(r.get(key), (int, float))
           and not isinstance(r.get(key), bool) and math.isfinite(float(r[key]))]
    return [p[0] for p in pts], [p[1] for p in pts]


def render(runs: dict[str, list[dict]], out: str | Path, panels: tuple[Panel, ...] = PANELS) -> list[str]:
    """Draw ``panels`` that have data into the PNG ``out`` (written as is; see ``plot`` for the
    guarded, atomic write). Returns the titles of the panels drawn, in order."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise ValueError(f"glm5 plot draws with matplotlib, which is not installed ({e}): pip install matplotlib") \
            from None

    present = [p for p in panels if any(_series(rows, k)[0] for rows in runs.values() for k in p.metrics)]
    if not present:
        known = sorted({k for p in panels for k in p.metrics})
        raise ValueError(f"{', '.join(runs)}: none of the plotted metrics is in metrics.jsonl ({', '.join(known)})")
    cols = min(3, len(present))
    rows_n = -(-len(present) // cols)
    fig = Figure(figsize=(5.2 * cols, 3.6 * rows_n), layout="constrained")
    FigureCanvasAgg(fig)
    styles = ("-", "--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)))
    for i, panel in enumerate(present):
        ax = fig.add_subplot(rows_n, cols, i + 1)
        keys = [k for k in panel.metrics if any(_series(rows, k)[0] for rows in runs.values())]
        ys = [v for rows in runs.values() for k in keys for v in _series(rows, k)[1]]
        huge = max(ys) - min(ys) > HUGE_SPAN  # inf when it overflows: matplotlib's linear axis cannot span it
        for r, (label, rows) in enumerate(runs.items()):
            for m, key in enumerate(keys):
                # one run: a colour per metric; several: a colour per run, a line style per metric
                color, style = (f"C{m % 10}", "-") if len(runs) == 1 else (f"C{r % 10}", styles[m % len(styles)])
                x, y = _series(rows, key)
                if not x:
                    continue
                name = label if len(keys) == 1 else f"{label}: {key}"
                ax.plot(x, y, linestyle=style, color=color, marker="o" if len(x) <= 25 else None, markersize=3,
                        linewidth=1.3, label=name)
        if panel.symlog or huge:
            ax.set_yscale("symlog", linthresh=panel.symlog or 1.0)
        if huge:  # no autoscale margin: past ±1e308 it overflows the symlog inverse too
            ax.set_ylim(min(ys), max(ys))
        ax.set_title(panel.title + (" (symlog: values span > 1e150)" if huge and not panel.symlog else ""),
                     fontsize=10)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5, loc="best")
    import numpy as np

    with np.errstate(over="ignore"):  # symlog ticks near ±1e308 overflow exp() harmlessly
        fig.savefig(out, format="png", dpi=100, metadata={_MARK_KEY: KIND})
    return [p.title for p in present]


def png_kind(path: str | Path) -> Optional[str]:
    """The ``glm5-output`` text chunk of a PNG (None: not a PNG, or not one ``glm5 plot`` wrote)."""
    with open(path, "rb") as f:
        if f.read(8) != b"\x89PNG\r\n\x1a\n":
            return None
        while True:
            head = f.read(8)
            if len(head) < 8:
                return None
            size, ctype = struct.unpack(">I4s", head)
            if ctype == b"IDAT" or ctype == b"IEND":  # matplotlib writes text chunks before the image data
                return None
            data = f.read(size)
            f.seek(4, os.SEEK_CUR)  # CRC
            if ctype == b"tEXt":
                key, _, value = data.partition(b"\0")
                if key.decode("latin-1") == _MARK_KEY:
                    return value.decode("latin-1")


def plot(run_dirs: list[str | Path], out: str | Path, overwrite: bool = False) -> list[str]:
    """Render ``run_dirs`` into ``out`` (a ``.png`` path); never replaces a file this command did not
    write (unless ``overwrite``) nor an input; a failure leaves a previous ``out`` as it was.
    Returns the panel titles drawn."""
    out = Path(out)
    if out.suffix.lower() != ".png":
        raise ValueError(f"{out}: --out must name a .png file")
    runs = load_runs(run_dirs)
    check_output_file(out, KIND, png_kind, inputs=[Path(d) / METRICS_FILE for d in run_dirs], overwrite=overwrite)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        titles = render(runs, tmp)
        publish_file(tmp)
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return titles

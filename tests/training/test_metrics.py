"""``RUN/metrics.jsonl`` (``glm5_mcore.training.run_log``) and ``glm5 plot``: rows continued across a resume
without repeating a step, the PNG's panels, and ``--out`` / bad run folders refused without harm.
(Real SFT and RL runs write and plot theirs in tests/recipes/test_sft.py and tests/rl/test_ray.py.)"""

import json
from pathlib import Path

import pytest

from glm5_mcore.plot import RL_PANELS, SFT_PANELS, png_kind, plot
from glm5_mcore.training.run_log import METRICS_FILE, MetricsFile, read_metrics

from tests.support.launch import glm5



def _write_run(folder: Path, steps, **extra) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    f = MetricsFile(folder)
    for s in steps:
        f.write(s, {"loss": 3.0 / s, "lr": 1e-3, "grad_norm": 1.0 / s, "tokens_per_s": 100.0 + s,
                    "note": "not a scalar", **extra})
    f.close()
    return folder


def test_metrics_file_resume_drops_later_steps_and_fresh_start_clears(tmp_path):
    run = _write_run(tmp_path / "run", range(1, 6))
    with open(run / METRICS_FILE, "a") as f:
        f.write('{"step": 6, "loss"')  # torn: killed mid-write
    f = MetricsFile(run, start_step=3)  # resumed from the step-3 checkpoint
    for s in (4, 5):
        f.write(s, {"loss": 9.0, "grad_norm": float("nan")})
    f.close()
    rows = read_metrics(run / METRICS_FILE)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert rows[2]["loss"] == 1.0 and rows[3]["loss"] == 9.0
    assert rows[4]["grad_norm"] is None and "note" not in rows[0]  # strict JSON: NaN as null, scalars only
    json.loads((run / METRICS_FILE).read_text().splitlines()[-1])
    before = (run / METRICS_FILE).read_bytes()
    MetricsFile(run, start_step=0).close()  # a fresh start that logs nothing (failed first step): untouched
    assert (run / METRICS_FILE).read_bytes() == before
    f = MetricsFile(run, start_step=0)  # a fresh start: its first row replaces the file
    f.write(1, {"loss": 7.0})
    f.close()
    assert [r["step"] for r in read_metrics(run / METRICS_FILE)] == [1]


@pytest.mark.slow
def test_plot_panels_and_refusals(tmp_path):
    a = _write_run(tmp_path / "sft_a", range(1, 11), val_loss=2.0)
    b = _write_run(tmp_path / "sft_b", range(1, 8))
    out = tmp_path / "cmp.png"
    assert plot([a, b], out) == [p.title for p in SFT_PANELS]
    assert out.stat().st_size > 10_000 and png_kind(out) == "plot"
    before = out.read_bytes()
    assert plot([a], out) == [p.title for p in SFT_PANELS]  # its own previous output: replaced
    assert out.read_bytes() != before

    def glm5_plot(*args):
        return glm5("plot", *args, ok=False, timeout=300)

    other = tmp_path / "photo.png"
    other.write_bytes(b"\x89PNG\r\n\x1a\n not ours")
    notes = tmp_path / "notes.txt"
    notes.write_text("keep me")
    empty = tmp_path / "empty_run"
    empty.mkdir()
    for args, says in (([a, "--out", other], f"{other}: --out names an existing file that is not a previous 'plot'"),
                       ([a, "--out", notes], f"{notes}: --out must name a .png file"),
                       ([a, empty, "--out", tmp_path / "x.png"], f"{empty}: no {METRICS_FILE} in it"),
                       ([a, "--out", a / METRICS_FILE], "must name a .png file")):
        r = glm5_plot(*args)
        assert r.returncode == 2 and r.stderr.startswith("glm5 plot: error: ") and says in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert other.read_bytes() == b"\x89PNG\r\n\x1a\n not ours" and notes.read_text() == "keep me"
    assert not (tmp_path / "x.png").exists() and not list(tmp_path.glob(".*tmp*"))
    r = glm5_plot(a, "--out", other, "--overwrite")
    assert r.returncode == 0 and png_kind(other) == "plot", r.stderr
    assert "panels: " + "; ".join(p.title for p in SFT_PANELS) in r.stdout


def test_panel_lists_name_the_issue_metrics():
    """The panels the RL runs get hold the metrics the driver logs (names as W&B gets them)."""
    names = {k for p in RL_PANELS for k in p.metrics}
    assert {"critic/score/mean", "val/reward", "response_length/mean", "actor/entropy", "actor/ref_kl",
            "rollout_corr/kl", "rollout_corr/rollout_is_oob_ratio", "rollout_corr/logprob_abs_diff_mean",
            "timing_s/gen", "timing_s/update_actor"} <= names
    with pytest.raises(ValueError, match="none of the plotted metrics"):
        from glm5_mcore.plot import render

        render({"r": [{"step": 1, "other": 1.0}]}, Path("/dev/null"))


def test_plot_draws_values_near_the_float_limit(tmp_path):
    """Issue 34 class 14: a diverged run logging ±1e308 (finite, but its span overflows) failed inside
    matplotlib ("arange: cannot compute length"); that panel is now drawn on a symlog axis."""
    run = _write_run(tmp_path / "diverged", [])
    with open(run / METRICS_FILE, "w") as f:
        for s in range(1, 6):
            f.write(json.dumps({"step": s, "loss": 1e308 if s % 2 else -1e308, "lr": 1e-3}) + "\n")
    out = tmp_path / "d.png"
    assert plot([run], out) == ["loss (train, val)", "learning rate"]
    assert png_kind(out) == "plot" and out.stat().st_size > 10_000

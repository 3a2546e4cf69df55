"""The docs' commands run as written: every fenced ``bash`` block right after a ``<!-- runs-in-test -->``
line in README.md or docs/*.md runs, in order, in a fresh copy of the repository (its tracked and
unignored files, no ``runs/``; ``.venv`` linked in) with quick step counts — ``train.steps`` /
``trainer.steps`` set to 2 on every ``glm5 sft`` / ``glm5 rl`` line — and ``./setup.sh &&`` left out
(the suite runs in the environment it made). README's two commands stay exactly as they are; its main job
(the first block) runs to its reward instead (``test_readme_main_job_learns_the_toy_task``)."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.support.launch import REPO, RL_COMMAND, child_env

MARK = "<!-- runs-in-test -->"
SETUP = "./setup.sh && "
MAIN_JOB = "./setup.sh && .venv/bin/glm5 tiny --out runs/tiny && .venv/bin/glm5 rl"
TEST_COMMAND = "./setup.sh && OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -n 2 --dist loadgroup tests"


def runnable_blocks(root: Path = REPO) -> list[tuple[str, str]]:
    """[(``file:line``, block text)] of every marked block, README.md first, then docs/ by name."""
    out = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.strip() != MARK:
                continue
            if i + 1 >= len(lines) or lines[i + 1].strip() != "```bash":
                raise ValueError(f"{path.relative_to(root)}:{i + 1}: {MARK} must be followed by a ```bash block")
            end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
            out.append((f"{path.relative_to(root)}:{i + 2}", "\n".join(lines[i + 2:end]) + "\n"))
    return out


def quick(block: str) -> str:
    """The block with ``./setup.sh &&`` dropped and 2 training steps on each ``glm5 sft`` / ``glm5 rl``
    command (an existing ``train.steps=`` / ``trainer.steps=`` is replaced, otherwise one is appended)."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        line = line.replace(SETUP, "")
        parts = []
        for cmd in line.split("&&"):
            code, _, comment = cmd.partition("  #")
            m = re.search(r"(?:glm5|recipes\.main) (sft|rl)\b", code)
            if m:
                key = "train.steps" if m.group(1) == "sft" else "trainer.steps"
                code = (re.sub(rf"\b{key}=\d+", f"{key}=2", code) if f"{key}=" in code
                        else f"{code.rstrip()} {key}=2 ")
            parts.append(code)
        out.append("&&".join(parts).rstrip())
    return "\n".join(out) + "\n"


def test_readme_keeps_the_two_commands_and_every_mark_is_on_a_bash_block():
    text = (REPO / "README.md").read_text()
    assert f"```bash\n{MAIN_JOB}\n```" in text and f"```bash\n{TEST_COMMAND}\n```" in text
    blocks = runnable_blocks()
    assert blocks[0][1] == MAIN_JOB + "\n" and any("glm5 sft" in b for _, b in blocks), blocks
    assert quick(MAIN_JOB) == ".venv/bin/glm5 tiny --out runs/tiny && .venv/bin/glm5 rl trainer.steps=2\n"
    assert "train.steps=2 train.eval_every" in quick(".venv/bin/glm5 sft a=1 \\\n  train.steps=60 train.eval_every=20\n")


@pytest.fixture(scope="module")
def fresh_copy(tmp_path_factory):
    """The repository as a clone would have it (tracked + unignored files), with this checkout's venvs."""
    root = tmp_path_factory.mktemp("clone") / "glm5-mcore"
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for f in filter(None, files):
        src = REPO / f
        if src.is_file() and not src.is_symlink():
            (root / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / f)
    for venv in (".venv", ".venv-vllm"):
        if (REPO / venv).exists():
            os.symlink((REPO / venv).resolve(), root / venv)
    return root


@pytest.mark.slow
@pytest.mark.ray
def test_readme_main_job_learns_the_toy_task(fresh_copy, tmp_path):
    """The README's main job as written (``./setup.sh &&`` left out), stopped at the first held-out reward
    >= 0.9 (``trainer.stop_at_reward``) with no periodic saves: the reward rises from chance (1/2), W&B
    writes its offline run under ``runs/rl/wandb``, the final policy is saved all the same, every step's
    metrics are in ``metrics.jsonl`` and ``glm5 plot`` draws the RL panels from them."""
    from glm5_mcore.checkpoint.layout import iterations, latest_iteration
    from glm5_mcore.plot import RL_PANELS, plot
    from glm5_mcore.training.run_log import read_metrics

    cmd = MAIN_JOB.replace(SETUP, "") + " trainer.stop_at_reward=0.9 trainer.save_every=0"
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", cmd], cwd=fresh_copy, capture_output=True, text=True,
                       env=child_env(WANDB_SILENT="true", PYTHONPATH=str(fresh_copy)), timeout=900)
    assert r.returncode == 0 and "Traceback" not in r.stderr, f"{cmd}\nexit {r.returncode}\n{r.stderr[-4000:]}"
    res = json.loads(r.stdout.strip().splitlines()[-1])
    val = dict((s, v) for s, v in res["val_reward"])
    assert val[0] <= 0.65, val                      # chance: a constant policy scores 0.5
    assert max(val.values()) >= 0.9, val
    out = fresh_copy / "runs" / "rl"
    assert list((out / "wandb").glob("offline-run-*")), "W&B offline run missing"
    assert iterations(out) == [res["steps"]] and latest_iteration(out) == res["steps"]
    rows = read_metrics(out / "metrics.jsonl")  # every step once, the W&B names, the held-out curve
    assert [r["step"] for r in rows] == list(range(len(rows))) and rows[-1]["step"] == res["steps"]
    assert [(r["step"], r["val/reward"]) for r in rows if "val/reward" in r] == [tuple(v) for v in res["val_reward"]]
    png = tmp_path / "rl.png"
    assert plot([out], png) == [x.title for x in RL_PANELS]
    assert png.stat().st_size > 20_000


def block_params() -> list:
    """The marked blocks after README's main job, a block that runs ``glm5 rl`` marked ``ray``."""
    return [pytest.param(w, b, id=w, marks=[pytest.mark.ray] if RL_COMMAND.search(b) else [])
            for w, b in runnable_blocks()[1:]]


@pytest.mark.slow
@pytest.mark.parametrize("where,block", block_params())
def test_marked_command_block_runs_as_written(where, block, fresh_copy):
    env = child_env(WANDB_MODE="disabled", WANDB_SILENT="true", PYTHONPATH=str(fresh_copy))
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", quick(block)], cwd=fresh_copy, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "Traceback" not in r.stderr, \
        f"{where}:\n{quick(block)}\nexit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"

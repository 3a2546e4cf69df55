"""The docs' commands run as written: every fenced ``bash`` block right after a ``<!-- runs-in-test -->``
line in README.md or docs/*.md runs in a fresh copy of the repository of its own (its tracked and
unignored files, no ``runs/``; ``.venv`` linked in) with quick step counts — ``train.steps`` /
``trainer.steps`` set to 2 on every ``glm5 sft`` / ``glm5 rl`` line — and ``./setup.sh &&`` left out
(the suite runs in the environment it made). Each block stands alone, in any order: first the ``glm5 tiny``
commands of the blocks above it that make a folder it reads run (``prerequisites``), as a reader who ran
those blocks has that folder. README's two commands stay exactly as they are; its main job (the first
block) runs to its reward instead (``test_readme_main_job_learns_the_toy_task``)."""

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.support.launch import REPO, RL_COMMAND, child_env, copy_repo

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


TINY = re.compile(r"(?:\.venv/bin/)?glm5 tiny --out (\S+)[^&\n#]*")


def prerequisites(blocks: list[tuple[str, str]], i: int) -> list[str]:
    """The ``glm5 tiny --out DIR ...`` commands of blocks ``[0, i)`` whose ``DIR`` block ``i`` reads and does
    not make itself (a reader who ran the blocks above has it)."""
    own = {m.group(1) for m in TINY.finditer(blocks[i][1])}
    out = []
    for _, block in blocks[:i]:
        for m in TINY.finditer(block):
            if m.group(1) not in own and re.search(rf"(?<![\w/.-]){re.escape(m.group(1))}(?![\w.-])", blocks[i][1]) \
                    and m.group(0).strip() not in out:
                out.append(m.group(0).strip())
    return out


def test_readme_keeps_the_two_commands_and_every_mark_is_on_a_bash_block():
    text = (REPO / "README.md").read_text()
    assert f"```bash\n{MAIN_JOB}\n```" in text and f"```bash\n{TEST_COMMAND}\n```" in text
    blocks = runnable_blocks()
    assert blocks[0][1] == MAIN_JOB + "\n" and any("glm5 sft" in b for _, b in blocks), blocks
    assert quick(MAIN_JOB) == ".venv/bin/glm5 tiny --out runs/tiny && .venv/bin/glm5 rl trainer.steps=2\n"
    assert "train.steps=2 train.eval_every" in quick(".venv/bin/glm5 sft a=1 \\\n  train.steps=60 train.eval_every=20\n")


def test_a_block_gets_the_tiny_checkpoints_the_blocks_above_made():
    blocks = [("a", ".venv/bin/glm5 tiny --out runs/tiny && .venv/bin/glm5 rl\n"),
              ("b", ".venv/bin/glm5 sft model.hf_dir=runs/tiny train.out=runs/sft\n"),
              ("c", ".venv/bin/glm5 tiny --out runs/tiny_mtp --mtp  # once\nglm5 sft model.hf_dir=runs/tiny_mtp\n"),
              ("d", ".venv/bin/glm5 tiny --out runs/tiny  # again\n.venv/bin/glm5 sft model.hf_dir=runs/tiny_mtp\n")]
    assert prerequisites(blocks, 0) == [] and prerequisites(blocks, 1) == [".venv/bin/glm5 tiny --out runs/tiny"]
    assert prerequisites(blocks, 2) == []  # it makes runs/tiny_mtp itself, and never reads runs/tiny
    assert prerequisites(blocks, 3) == [".venv/bin/glm5 tiny --out runs/tiny_mtp --mtp"]
    blocks = runnable_blocks()
    i = next(i for i, (w, _) in enumerate(blocks) if i and w.startswith("README.md"))  # README's SFT block
    assert prerequisites(blocks, i) == [".venv/bin/glm5 tiny --out runs/tiny"]


@pytest.fixture()
def fresh_copy(tmp_path):
    return copy_repo(tmp_path / "glm5-mcore")


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
    """The marked blocks after README's main job, each with what it assumes (``prerequisites``); a block that
    runs ``glm5 rl`` marked ``ray``."""
    blocks = runnable_blocks()
    return [pytest.param(w, b, prerequisites(blocks, i), id=w, marks=[pytest.mark.ray] if RL_COMMAND.search(b) else [])
            for i, (w, b) in enumerate(blocks) if i]


@pytest.mark.slow
@pytest.mark.parametrize("where,block,before", block_params())
def test_marked_command_block_runs_as_written(where, block, before, fresh_copy):
    env = child_env(WANDB_MODE="disabled", WANDB_SILENT="true", PYTHONPATH=str(fresh_copy))
    script = "".join(f"{cmd}\n" for cmd in before) + quick(block)
    r = subprocess.run(["bash", "-euo", "pipefail", "-c", script], cwd=fresh_copy, env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "Traceback" not in r.stderr, \
        f"{where}:\n{script}\nexit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"

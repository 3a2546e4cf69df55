"""The docs' commands run as written. Every fenced block in README.md and docs/*.md is either not a command
(```` ```text ````, ```` ```yaml ````, ```` ```json ````, ```` ```toml ````) or carries one mark, an HTML comment
on the line right above its fence:

- ``<!-- runs-in-test -->`` (a ```` ```bash ```` block): ``test_marked_command_block_runs_as_written`` runs it
  in a fresh copy of the repository of its own (tracked and unignored files, no ``runs/``; ``.venv`` linked
  in), one command line at a time, with quick step counts — ``train.steps`` / ``trainer.steps`` set to 2 on
  every ``glm5 sft`` / ``glm5 rl`` line — and ``./setup.sh &&`` left out (the suite runs in the environment
  it made). Each line must exit 0 without a traceback; a ``glm5 plan`` line may exit 1 where its last line
  is a plan that does not fit (what ``glm5 plan`` exits with then). Each block stands alone, in any order:
  first the ``glm5 tiny`` commands of the blocks above it that make a folder it reads run
  (``prerequisites``), as a reader who ran those blocks has that folder.
- ``<!-- runs-in-test: TARGET [TARGET ...] -->``: the block's commands are what those tests run (their own
  step counts, data and folders), so it is not run twice. A target is a file of this repository
  (``tests/x/test_y.py``, ``.ci/run``) or one test in it (``tests/x/test_y.py::test_z``): it must exist, and
  every preset (``--config NAME``) and script or test file (``*.py``, ``*.sh``) the block names must appear
  in the targets' source.
- ``<!-- needs: KIND[, KIND] (WHY) -->``: not run here; ``KIND`` is one of ``NEEDS`` and ``WHY`` says what
  the block needs that a 2-core CPU machine with this repository does not have.

A block with none of these fails ``test_every_doc_block_is_run_tied_or_marked``. README's two commands stay
exactly as they are; its main job runs to its reward (``test_readme_main_job_learns_the_toy_task``) and its
test command is what ``.ci/run`` runs."""

import ast
import json
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.launch import REPO, child_env, copy_repo, starts_ray_in

MARK = "<!-- runs-in-test -->"
TIE = re.compile(r"<!-- runs-in-test: (.+?) -->")
NEEDS_MARK = re.compile(r"<!-- needs: ([a-z, ]+?) \((.+)\) -->")
NEEDS = {
    "gpu": "a CUDA GPU (Transformer Engine, vLLM's CUDA build, TileLang, NCCL)",
    "checkpoint": "a real GLM-5 release or a checkpoint folder of another tool (Megatron-Bridge, Megatron-LM)",
    "data": "a dataset of your own that the repository does not ship",
    "cluster": "several nodes (a Ray cluster, Slurm)",
}
NOT_COMMANDS = {"text", "yaml", "json", "toml"}
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
SETUP = "./setup.sh && "
MAIN_JOB = "./setup.sh && .venv/bin/glm5 tiny --out runs/tiny && .venv/bin/glm5 rl"
TEST_COMMAND = "./setup.sh && OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -n 2 --dist loadgroup tests"


@dataclass(frozen=True)
class Block:
    where: str   # file:line of the fence
    lang: str    # the fence's info string ("" when none)
    text: str    # the lines inside the fence, each ending in a newline
    mark: str    # the HTML comment right above the fence, or ""


def doc_blocks(root: Path = REPO) -> list[Block]:
    """Every fenced block of README.md, then of docs/*.md by name, in document order."""
    out = []
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            m = FENCE.match(lines[i])
            if not m:
                i += 1
                continue
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip().startswith("```")), None)
            if end is None:
                raise ValueError(f"{path.relative_to(root)}:{i + 1}: a fence that is never closed")
            above = lines[i - 1].strip() if i else ""
            out.append(Block(f"{path.relative_to(root)}:{i + 1}", m.group(2),
                             "".join(f"{line[len(m.group(1)):]}\n" for line in lines[i + 1:end]),
                             above if above.startswith("<!--") else ""))
            i = end + 1
    return out


def runnable_blocks(root: Path = REPO) -> list[Block]:
    """The blocks marked ``<!-- runs-in-test -->``."""
    return [b for b in doc_blocks(root) if b.mark == MARK]


def tie_terms(block: str) -> set[str]:
    """What a tied block names that its tests must name too: presets (``--config NAME``, ``rl/`` left out)
    and script or test files (their base names)."""
    terms = {m.group(1).removeprefix("rl/") for m in re.finditer(r"--config(?:-name)?[ =](\S+)", block)}
    return terms | {Path(m.group(0)).name for m in re.finditer(r"[\w./-]+\.(?:py|sh)\b", block)}


def _test_source(source: str, name: str) -> str | None:
    """``source`` without the other ``test_*`` functions (what test ``name`` runs: its body, helpers,
    fixtures), or None where it defines no ``name``."""
    tests = [n for n in ast.walk(ast.parse(source))
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_")]
    if name not in {n.name for n in tests}:
        return None
    lines = source.splitlines(keepends=True)
    for n in sorted((n for n in tests if n.name != name), key=lambda n: -n.lineno):
        first = min([n.lineno, *(d.lineno for d in n.decorator_list)])
        del lines[first - 1:n.end_lineno]
    return "".join(lines)


def block_problems(root: Path = REPO) -> list[str]:
    """One line per block that is neither a non-command block nor correctly marked."""
    out = []
    for b in doc_blocks(root):
        if b.lang in NOT_COMMANDS:
            if b.mark:
                out.append(f"{b.where}: a ```{b.lang} block is not a command; its mark {b.mark} means nothing")
            continue
        first = b.text.strip().splitlines()[0] if b.text.strip() else ""
        if not b.mark:
            out.append(f"{b.where}: a ```{b.lang} block without a mark ({first[:60]!r}): mark it "
                       f"{MARK}, <!-- runs-in-test: TESTS -->, or <!-- needs: KIND (WHY) --> "
                       f"(KIND: {', '.join(NEEDS)}); a block that is not a command is ```text")
        elif b.mark == MARK:
            if b.lang != "bash":
                out.append(f"{b.where}: {MARK} must mark a ```bash block, not ```{b.lang}")
        elif m := TIE.fullmatch(b.mark):
            sources = {}
            for target in m.group(1).split():
                path, _, name = target.partition("::")
                f = root / path
                source = f.read_text() if f.is_file() else None
                if source is None:
                    out.append(f"{b.where}: tied to {target}, but {path} does not exist")
                elif name and (source := _test_source(source, name.partition("[")[0])) is None:
                    out.append(f"{b.where}: tied to {target}, but {path} defines no {name}")
                else:
                    sources[f.name] = source
            if sources:
                missing = sorted(t for t in tie_terms(b.text)
                                 if t not in sources and not any(t in s for s in sources.values()))
                if missing:
                    out.append(f"{b.where}: tied to {m.group(1)}, which never name {', '.join(missing)}")
        elif m := NEEDS_MARK.fullmatch(b.mark):
            bad = [k.strip() for k in m.group(1).split(",") if k.strip() not in NEEDS]
            if bad:
                out.append(f"{b.where}: needs {', '.join(bad)}: not a kind ({', '.join(NEEDS)})")
        else:
            out.append(f"{b.where}: {b.mark!r} is not a mark ({MARK}, <!-- runs-in-test: TESTS -->, "
                       f"<!-- needs: KIND (WHY) -->)")
    return out


def test_every_doc_block_is_run_tied_or_marked():
    problems = block_problems()
    assert not problems, "\n".join(problems)


def test_an_unmarked_or_wrongly_marked_block_is_found(tmp_path):
    """The check above on a made-up repository: each kind of mistake is one line naming the block."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_a.py").write_text("def test_a():\n    run('grpo_tiny')\n")
    (tmp_path / "README.md").write_text("# r\n\n```bash\nglm5 sft\n```\n\n<!-- needs: gpu (TE) -->\n```bash\nx\n```\n")
    (tmp_path / "docs" / "a.md").write_text(
        "```\nglm5 rl\n```\n"                                             # no mark, no language
        "```text\nDIR/\n```\n"                                            # not a command: fine
        "<!-- runs-in-test -->\n```sh\nglm5 rl\n```\n"                    # runs-in-test needs ```bash
        "<!-- runs-in-test: tests/test_a.py::test_a -->\n```bash\nglm5 rl --config grpo_tiny\n```\n"  # fine
        "<!-- runs-in-test: tests/test_a.py::test_b -->\n```bash\nglm5 rl\n```\n"
        "<!-- runs-in-test: tests/test_a.py -->\n```bash\nglm5 rl --config rl/ppo_gae_tiny\n```\n"
        "<!-- runs-in-test: tests/nope.py -->\n```bash\nglm5 rl\n```\n"
        "<!-- needs: tpu (a TPU) -->\n```bash\nglm5 rl\n```\n"
        "<!-- needs: gpu -->\n```bash\nglm5 rl\n```\n")
    assert block_problems(tmp_path) == [
        "README.md:3: a ```bash block without a mark ('glm5 sft'): mark it <!-- runs-in-test -->, "
        "<!-- runs-in-test: TESTS -->, or <!-- needs: KIND (WHY) --> (KIND: gpu, checkpoint, data, cluster); "
        "a block that is not a command is ```text",
        "docs/a.md:1: a ``` block without a mark ('glm5 rl'): mark it <!-- runs-in-test -->, "
        "<!-- runs-in-test: TESTS -->, or <!-- needs: KIND (WHY) --> (KIND: gpu, checkpoint, data, cluster); "
        "a block that is not a command is ```text",
        "docs/a.md:8: <!-- runs-in-test --> must mark a ```bash block, not ```sh",
        "docs/a.md:16: tied to tests/test_a.py::test_b, but tests/test_a.py defines no test_b",
        "docs/a.md:20: tied to tests/test_a.py, which never name ppo_gae_tiny",
        "docs/a.md:24: tied to tests/nope.py, but tests/nope.py does not exist",
        "docs/a.md:28: needs tpu: not a kind (gpu, checkpoint, data, cluster)",
        "docs/a.md:32: '<!-- needs: gpu -->' is not a mark (<!-- runs-in-test -->, <!-- runs-in-test: TESTS -->, "
        "<!-- needs: KIND (WHY) -->)"]


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


def command_lines(script: str) -> list[str]:
    """The script's commands, one a line (``quick`` has joined continuations): blank and comment lines left out."""
    return [line for line in script.splitlines() if line.strip() and not line.lstrip().startswith("#")]


TINY = re.compile(r"(?:\.venv/bin/)?glm5 tiny --out (\S+)[^&\n#]*")
PLAN = re.compile(r"(?:glm5|recipes\.main) plan\b")


def prerequisites(blocks: list[str], i: int) -> list[str]:
    """The ``glm5 tiny --out DIR ...`` commands of blocks ``[0, i)`` whose ``DIR`` block ``i`` reads and does
    not make itself (a reader who ran the blocks above has it)."""
    own = {m.group(1) for m in TINY.finditer(blocks[i])}
    out = []
    for block in blocks[:i]:
        for m in TINY.finditer(block):
            if m.group(1) not in own and re.search(rf"(?<![\w/.-]){re.escape(m.group(1))}(?![\w.-])", blocks[i]) \
                    and m.group(0).strip() not in out:
                out.append(m.group(0).strip())
    return out


def test_readme_keeps_the_two_commands_and_ci_runs_the_test_command():
    text = (REPO / "README.md").read_text()
    assert f"```bash\n{MAIN_JOB}\n```" in text and f"```bash\n{TEST_COMMAND}\n```" in text
    main_job, tests = [b for b in doc_blocks() if b.where.startswith("README.md")][:2]
    assert main_job.text == MAIN_JOB + "\n" and main_job.mark == \
        "<!-- runs-in-test: tests/test_docs.py::test_readme_main_job_learns_the_toy_task -->"
    assert tests.text == TEST_COMMAND + "\n" and tests.mark == "<!-- runs-in-test: .ci/run -->"
    ci = (REPO / ".ci" / "run").read_text()
    assert "\n./setup.sh\n" in ci and TEST_COMMAND.replace(SETUP, "").replace(" tests", " --durations=30 tests") in ci
    assert any("glm5 sft" in b.text for b in runnable_blocks())
    assert quick(MAIN_JOB) == ".venv/bin/glm5 tiny --out runs/tiny && .venv/bin/glm5 rl trainer.steps=2\n"
    assert starts_ray_in(MAIN_JOB) and not starts_ray_in(".venv/bin/glm5 rl --config glm5_744b --cfg job  # print\n")
    assert "train.steps=2 train.eval_every" in quick(".venv/bin/glm5 sft a=1 \\\n  train.steps=60 train.eval_every=20\n")


def test_a_block_gets_the_tiny_checkpoints_the_blocks_above_made():
    blocks = [".venv/bin/glm5 tiny --out runs/tiny && .venv/bin/glm5 rl\n",
              ".venv/bin/glm5 sft model.hf_dir=runs/tiny train.out=runs/sft\n",
              ".venv/bin/glm5 tiny --out runs/tiny_mtp --mtp  # once\nglm5 sft model.hf_dir=runs/tiny_mtp\n",
              ".venv/bin/glm5 tiny --out runs/tiny  # again\n.venv/bin/glm5 sft model.hf_dir=runs/tiny_mtp\n"]
    assert prerequisites(blocks, 0) == [] and prerequisites(blocks, 1) == [".venv/bin/glm5 tiny --out runs/tiny"]
    assert prerequisites(blocks, 2) == []  # it makes runs/tiny_mtp itself, and never reads runs/tiny
    assert prerequisites(blocks, 3) == [".venv/bin/glm5 tiny --out runs/tiny_mtp --mtp"]
    readme_sft = next(p for p in block_params() if p.id.startswith("README.md"))
    assert readme_sft.values[2] == [".venv/bin/glm5 tiny --out runs/tiny"]  # the main job's, above it


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
    """The ``<!-- runs-in-test -->`` blocks, each with what it assumes (``prerequisites`` from every command
    block above it, marked any way); a block that starts Ray (``starts_ray_in``) marked ``ray``."""
    blocks = [b for b in doc_blocks() if b.lang not in NOT_COMMANDS]
    texts = [b.text for b in blocks]
    return [pytest.param(b.where, b.text, prerequisites(texts, i), id=b.where,
                         marks=[pytest.mark.ray] if starts_ray_in(b.text) else [])
            for i, b in enumerate(blocks) if b.mark == MARK]


def _fits_false(stdout: str) -> bool:
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    return bool(lines) and json.loads(lines[-1]).get("plan", {}).get("fits") is False


@pytest.mark.slow
@pytest.mark.parametrize("where,block,before", block_params())
def test_marked_command_block_runs_as_written(where, block, before, fresh_copy):
    env = child_env(WANDB_MODE="disabled", WANDB_SILENT="true", PYTHONPATH=str(fresh_copy))
    for line in [*before, *command_lines(quick(block))]:
        r = subprocess.run(["bash", "-uo", "pipefail", "-c", line], cwd=fresh_copy, env=env,
                           capture_output=True, text=True, timeout=900)
        ok = r.returncode == 0 or (r.returncode == 1 and PLAN.search(line) and _fits_false(r.stdout))
        assert ok and "Traceback" not in r.stderr, \
            f"{where}:\n{line}\nexit {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"

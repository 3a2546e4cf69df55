"""The presets a user copies (issue 31 item 4), end to end on CPU with Ray and the tiny model:
``math_verl_tiny`` (a verl-format parquet, math-verify in the reward pool) and ``code_tool_tiny`` (tool
episodes with the Python sandbox). Each run: rewards computed, reward/timeouts and reward/errors in
metrics.jsonl (tool/* for the episodes: the random policy's calls are unparsable, each an observation that
says so), and a resumed run repeats step 3 exactly."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rl.test_ray import ray_local  # noqa: F401 (fixture: PYTHONPATH for the Ray workers, shutdown)
from tests.support.rl_setup import killed_before_last_save
from tests.support.tool_attack import write_env

REPO = Path(__file__).resolve().parents[2]
SAME = ("critic/score/mean", "actor/pg_loss", "actor/entropy", "actor/grad_norm", "response_length/mean",
        "reward/timeouts", "reward/errors")


@pytest.fixture(scope="module")
def verl_math(tmp_path_factory):
    out = tmp_path_factory.mktemp("verl") / "math"
    subprocess.run([sys.executable, str(REPO / "scripts" / "make_verl_math.py"), "--out", str(out), "--train", "32",
                    "--test", "8"], check=True, capture_output=True)
    return out


def _cfg(preset, tiny_dir, data, out, *extra):
    from recipes.cli import compose
    from rl.config import RLConfig

    return RLConfig.from_dict(compose(f"rl/{preset}", [
        f"model.hf_dir={tiny_dir}", f"data.train={data / 'train.parquet'}", f"data.val={data / 'test.parquet'}",
        f"trainer.out={out}", "wandb.mode=disabled", "trainer.progress=false", "trainer.steps=3",
        "trainer.save_every=2", "trainer.eval_every=0", "rollout.num_actors=1", "data.prompts_per_step=4",
        "actor.ppo_mini_batch_size=4", "rollout.n=2", *extra]))


def _run_and_resume(preset, tiny_dir, verl_math, tmp_path, *extra):
    from glm5_mcore.training.run_log import read_metrics
    from rl.driver import run

    a, b = tmp_path / "a", tmp_path / "b"
    full = run(_cfg(preset, tiny_dir, verl_math, a, *extra))
    shutil.copytree(a, b)
    killed_before_last_save(b, 3, 2)  # holds iteration 2; step 3 is redone from it
    resumed = run(_cfg(preset, tiny_dir, verl_math, b, *extra))
    assert [h["step"] for h in resumed["history"]] == [3]
    x, y = full["history"][2], resumed["history"][0]
    for k in SAME + tuple(k for k in x if k.startswith("tool/")):
        assert x[k] == y[k], (k, x[k], y[k])
    rows = read_metrics(a / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["reward/timeouts"] == 0.0 and r["reward/errors"] == 0.0 for r in rows)
    return rows


@pytest.mark.slow
@pytest.mark.ray
def test_math_verl_preset_runs_scores_and_resumes(tiny_dir, verl_math, tmp_path, ray_local):
    rows = _run_and_resume("math_verl_tiny", tiny_dir, verl_math, tmp_path)
    assert all("critic/score/mean" in r for r in rows)


@pytest.mark.slow
@pytest.mark.ray
def test_code_tool_preset_runs_masked_episodes_and_resumes(tiny_dir, verl_math, tmp_path, ray_local, capsys):
    """Issue 42: every tool call also runs a hostile call that looks for the driver's ``data.train=`` in
    /proc and reads the training file, this project's source and the model's config (the red team's run
    returned the whole answer key as its observation): none is found or read, and the run's log names the
    sandbox the calls ran under."""
    targets = [verl_math / "train.parquet", REPO / "rl" / "tasks" / "sandbox.py", Path(tiny_dir) / "config.json"]
    env = write_env(tmp_path / "env", targets)
    rows = _run_and_resume("code_tool_tiny", tiny_dir, verl_math, tmp_path, "rollout.max_new_tokens=6",
                           f"rollout.multi_turn.env={env}")
    calls = sum(r["tool/calls"] for r in rows)
    assert calls > 0 and sum(r["tool/errors"] + r["tool/timeouts"] for r in rows) == 0  # no env failure
    seen = [json.loads(line) for line in (tmp_path / "env" / "observations.jsonl").read_text().splitlines()]
    assert len(seen) >= calls
    for obs in seen:
        found = json.loads(obs["hostile"])
        assert found["cmdline"] == [] and found["read"] == {} and found["pids"] <= 2, found
        assert sorted(found["refused"]) == sorted(map(str, targets)), found
    assert "tool sandbox: bubblewrap" in capsys.readouterr().out

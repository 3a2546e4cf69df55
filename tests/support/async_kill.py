"""The async SIGKILL / resume check shared by the HF-engine and vLLM-engine tests: ``glm5 rl`` (4 steps,
checkpoints at 2 and 4, 4 prompts per step) SIGKILLed while the engines generate past the step-2 checkpoint,
then the same command again; the ledgers of the two checkpoints must hold every slot of the prompt stream once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from rl.schedule.async_ledger import expand
from tests.support.launch import child_env, glm5, torchrun_cmd

PROMPTS = 4
STEPS = 4
ARGS = [f"trainer.steps={STEPS}", "trainer.save_every=2", "trainer.max_staleness=2", "trainer.eval_every=0",
        "trainer.progress=false", "data.val=null", f"data.prompts_per_step={PROMPTS}", "rollout.n=2",
        "actor.ppo_mini_batch_size=4", "wandb.mode=disabled"]


def kill_then_resume(tmp_path: Path, *extra: str) -> list[dict]:
    """Run, SIGKILL once step 3 is logged past the step-2 checkpoint, resume; assert that the run completes,
    the resumed log says the buffered groups were regenerated, and the last checkpoint's ledger holds every
    slot once (trained, pending or dropped) with steps x prompts trained, the killed run's among them.
    Returns the per-step metrics of both runs."""
    out = tmp_path / "rl"
    args = ["rl", f"trainer.out={out}", *ARGS, *extra]
    log = tmp_path / "killed.log"
    with open(log, "w") as f:  # its own session: the kill takes Ray's processes (and vLLM's) with it
        proc = subprocess.Popen(torchrun_cmd("-m recipes.main", *args, nproc=1), env=child_env(WANDB_SILENT="true"),
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True, cwd=tmp_path)
    metrics = out / "metrics.jsonl"
    try:
        deadline = time.time() + 600
        while proc.poll() is None and time.time() < deadline and not (
                (out / "latest").is_file() and metrics.is_file() and '"step": 3' in metrics.read_text()):
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL, log.read_text()[-3000:]
    assert int((out / "latest").read_text()) == 2
    killed = json.loads((out / "iter_0000002" / "trainer_state.json").read_text())["async"]
    assert killed["pending"]  # groups were buffered / in flight at the checkpoint
    p = glm5(*args, cwd=tmp_path, env=child_env(WANDB_SILENT="true"), timeout=600)
    assert "prompt group(s) that were buffered or being generated at the checkpoint: regenerated first" in \
        p.stdout + p.stderr
    end = json.loads((out / f"iter_{STEPS:07d}" / "trainer_state.json").read_text())["async"]
    trained = expand(end["trained"])
    assert len(trained) == len(set(trained)) == STEPS * PROMPTS
    assert set(expand(killed["trained"])) <= set(trained)
    every = trained + [g * PROMPTS + j for g, j, _ in end["pending"]] + expand(end["dropped"])
    assert sorted(every) == list(range(end["next_batch"] * PROMPTS))
    return [json.loads(line) for line in metrics.read_text().splitlines() if '"step"' in line]

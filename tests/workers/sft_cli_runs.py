"""Run under torchrun: several ``glm5 sft`` command lines in one process group, in order, each through the console's
own entry point (``recipes.main.main(["sft", ...])``: Hydra, the checks, the one-line errors), so a test that
chains runs (save, copy, resume at another layout, a refusal) pays for one launch instead of one per run.

``python -m torch.distributed.run ... sft_cli_runs.py RUNS.json``: RUNS.json is a list of ``{"name", "argv": [...],
"copy": [[src, dst], ...]}`` (``copy``: folders rank 0 copies before the run, every rank waiting for it). Rank 0
prints one JSON line: {name: {"rc", "out": the run's JSON summary (None if it printed none), "errors": each rank's
``glm5 sft: error:`` lines, "traceback": whether any rank printed one}}."""

import contextlib
import io
import json
import shutil
import sys

import torch.distributed as dist

from recipes.main import main as glm5


def _run(argv: list[str]) -> dict:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = glm5(["sft", *argv])
    lines = [ln for ln in out.getvalue().splitlines() if ln.startswith("{")]
    return {"rc": rc, "out": json.loads(lines[-1]) if lines else None,
            "errors": [ln for ln in err.getvalue().splitlines() if ln.startswith("glm5 sft: error:")],
            "traceback": "Traceback" in err.getvalue()}


def main(runs_file: str) -> None:
    results = {}
    for run in json.loads(open(runs_file).read()):
        if dist.is_initialized():  # the first run starts the process group
            if dist.get_rank() == 0:
                for src, dst in run.get("copy", []):
                    shutil.copytree(src, dst)
            dist.barrier()
        elif run.get("copy"):
            raise ValueError(f"{run['name']}: copies before the first run (no process group yet to wait on)")
        mine = _run(run["argv"])
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
        results[run["name"]] = {"rc": [r["rc"] for r in ranks], "out": ranks[0]["out"],
                                "errors": [e for r in ranks for e in r["errors"]],
                                "traceback": any(r["traceback"] for r in ranks)}
    if dist.get_rank() == 0:
        print(json.dumps(results), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])

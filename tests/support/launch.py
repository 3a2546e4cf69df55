"""Child processes of the tests: one environment (``child_env``), one launcher (``torchrun``) and the
``glm5`` console in a subprocess (``glm5``), in place of the copies each test file carried.

Every child gets a fresh rendezvous (the pytest process holds its own process group, so its
``MASTER_ADDR`` / ``MASTER_PORT`` / ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` are dropped), one
thread, and this checkout first on ``PYTHONPATH`` (so ``tests.support`` wins over the ``tests``
package verl installs in site-packages, and Ray workers import ``tests.support.rl_fault_engine``).
A test that starts one of these is marked ``slow``."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKERS = REPO / "tests" / "workers"
_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
RL_COMMAND = re.compile(r"(?:glm5|recipes\.main) rl\b")
"""A ``glm5 rl`` command in a command line or a doc block: it starts Ray (such tests are marked ``ray``)."""


def starts_ray_in(command: str) -> bool:
    """Whether a shell command (or a doc block) runs a ``glm5 rl`` that starts Ray: one not given ``--cfg`` or
    ``--help`` (Hydra then prints the config or the help and nothing runs)."""
    return any(RL_COMMAND.search(part) and not re.search(r"(?:^|\s)(?:--cfg|--help|-h)(?=\s|$)", part)
               for part in re.split(r"&&|\|\||;|\n", command))


def child_env(**extra: str) -> dict[str, str]:
    """``os.environ`` without the pytest process's rendezvous, with ``OMP_NUM_THREADS=1`` and the
    checkout first on ``PYTHONPATH``; ``extra`` overrides (e.g. ``WANDB_SILENT="true"``)."""
    env = {k: v for k, v in os.environ.items() if k not in _RENDEZVOUS}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p))
    env.update(extra)
    return env


def run_child(cmd: list[str], *, ok: bool = True, timeout: int = 600, env: dict | None = None,
        cwd=None) -> subprocess.CompletedProcess:
    """``cmd`` in ``child_env()`` (or ``env``), output captured as text; with ``ok`` its exit status
    must be 0 (the failure shows the tails of stdout and stderr)."""
    r = subprocess.run([str(c) for c in cmd], env=env or child_env(), capture_output=True, text=True,
                       timeout=timeout, cwd=cwd)
    if ok:
        assert r.returncode == 0, f"{' '.join(map(str, cmd[:8]))} exited {r.returncode}\n" \
                                  f"{r.stdout[-3000:]}\n{r.stderr[-6000:]}"
    return r


def torchrun_cmd(target: str, *args, nproc: int = 2) -> list[str]:
    """The command line: ``target`` is a worker script in ``tests/workers/`` (``"layout_matrix.py"``) or a
    module (``"-m recipes.main"``); ``nproc`` 1 runs it in a plain Python process, more under
    ``torch.distributed.run --standalone``."""
    entry = target.split() if target.startswith("-m ") else [str(WORKERS / target)]
    launcher = ([sys.executable] if nproc == 1 else
                [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)])
    return [*launcher, *entry, *map(str, args)]


def torchrun(target: str, *args, nproc: int = 2, ok: bool = True, timeout: int = 600,
             env: dict | None = None, cwd=None) -> subprocess.CompletedProcess:
    """Run ``target`` (see ``torchrun_cmd``) on ``nproc`` gloo ranks and return the finished process."""
    return run_child(torchrun_cmd(target, *args, nproc=nproc), ok=ok, timeout=timeout, env=env, cwd=cwd)


def glm5(*args, nproc: int = 1, ok: bool = True, timeout: int = 600, env: dict | None = None,
         cwd=None) -> subprocess.CompletedProcess:
    """The ``glm5`` console (``python -m recipes.main ARGS``) in a child process, on ``nproc`` ranks."""
    return torchrun("-m recipes.main", *args, nproc=nproc, ok=ok, timeout=timeout, env=env, cwd=cwd)


def last_json(stdout: str) -> dict:
    """The last line of ``stdout`` that is a JSON object (how the workers and CLIs report)."""
    return json.loads([line for line in stdout.splitlines() if line.startswith("{")][-1])


def copy_repo(root: Path, skip: tuple = ()) -> Path:
    """The repository as a clone would have it (tracked + unignored files, those under the ``skip`` prefixes
    left out) in ``root``, with this checkout's venvs linked in."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for f in filter(None, files):
        src = REPO / f
        if src.is_file() and not src.is_symlink() and not f.startswith(skip):
            (root / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, root / f)
    for venv in (".venv", ".venv-vllm"):
        if (REPO / venv).exists():
            os.symlink((REPO / venv).resolve(), root / venv)
    return root

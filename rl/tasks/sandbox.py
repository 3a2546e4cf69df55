"""A Python sandbox for tool episodes: one fresh interpreter per call, in an empty folder, under limits.

``run_python(code, limits)`` starts ``python -I -`` (isolated mode: no site-packages of the user, no
PYTHONPATH, no current folder on ``sys.path``; the code comes on stdin) with:

- an empty working folder made for the call and removed after it (nothing else is deleted);
- ``resource.setrlimit`` limits: CPU seconds (``RLIMIT_CPU``: SIGXCPU, then SIGKILL at +1 s), address
  space (``RLIMIT_AS``: a large allocation raises ``MemoryError``), file size (``RLIMIT_FSIZE``), process
  count (``RLIMIT_NPROC``), open files, no core dumps;
- where the machine allows it (``unshare``: as root, or with unprivileged user namespaces), new network,
  mount and PID namespaces: no network interface but loopback, which is down (a connect fails), ``/tmp``,
  ``/var/tmp`` and ``/dev/shm`` are empty private tmpfs (writes there vanish with the call), and when the
  call ends every process it started dies with the namespace (a fork bomb is contained). As root the
  code runs as ``nobody``, so ``RLIMIT_NPROC`` holds and a write outside its folder fails wherever the
  permissions deny it to ``nobody`` (the world-writable temp folders are the private tmpfs above; a
  folder elsewhere made world-writable by hand would be writable);
- a wall timeout (the whole process tree is killed), and stdout / stderr kept up to ``max_output_bytes``
  each (the rest is read and dropped, so a flood cannot fill the driver's memory).

``SandboxResult.status``: ``ok`` (exit 0), ``error`` (non-zero exit: an exception, ``MemoryError``),
``killed`` (a signal: CPU limit, file-size limit), ``timeout`` (wall clock). The namespace setup runs in
this same file as a small boot process (``python -I rl/tasks/sandbox.py SPEC``): PID 1 of the new namespace,
it mounts the private tmpfs, forks the limited interpreter and reports its exit.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from functools import lru_cache
from typing import Optional

NOBODY = 65534
PRIVATE_TMP = ("/tmp", "/var/tmp", "/dev/shm")


@dataclass
class SandboxLimits:
    cpu_s: int = 5
    memory_mb: int = 1024
    file_mb: int = 16
    processes: int = 64
    open_files: int = 64
    wall_s: float = 10.0
    max_output_bytes: int = 65536


@dataclass
class SandboxResult:
    status: str
    returncode: Optional[int]
    stdout: str
    stderr: str
    wall_s: float
    truncated: bool = False
    isolated_network: bool = False


@lru_cache(maxsize=None)
def namespace_prefix() -> tuple[str, ...]:
    """The ``unshare`` command that gives new network, mount and PID namespaces here, or () when the
    machine allows none (then the network is not isolated; ``SandboxResult.isolated_network`` says so)."""
    base = ("unshare", "--net", "--mount", "--pid", "--fork", "--kill-child")
    if shutil.which("unshare") is None:
        return ()
    for prefix in (base, base[:1] + ("--user", "--map-root-user") + base[1:]):
        if os.geteuid() != 0 and "--user" not in prefix:
            continue
        try:
            if subprocess.run(prefix + ("true",), capture_output=True, timeout=10).returncode == 0:
                return prefix
        except (OSError, subprocess.TimeoutExpired):
            pass
    return ()


def _others_can_run(path: str) -> bool:
    """Every folder above ``path`` and the file itself have the others' execute bit (``nobody`` can run it)."""
    import stat

    path = os.path.realpath(path)
    parts = [path] + [os.path.dirname(path)]
    while parts[-1] != os.path.dirname(parts[-1]):
        parts.append(os.path.dirname(parts[-1]))
    return all(os.stat(p).st_mode & stat.S_IXOTH for p in parts)


@lru_cache(maxsize=None)
def sandbox_python(drop: bool) -> str:
    """This process's interpreter, or (running as ``nobody``, when it lives where ``nobody`` cannot reach,
    e.g. under /root) the system's ``python3``."""
    if not drop or _others_can_run(sys.executable):
        return os.path.realpath(sys.executable)
    found = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if found is None or not _others_can_run(found):
        raise RuntimeError(f"sandbox: no Python interpreter the sandbox user can run ({sys.executable} is not "
                           "reachable for nobody, and there is no system python3); pass python=")
    return found


def _drain(pipe, cap: int, out: list) -> None:
    kept, total = bytearray(), 0
    while True:
        chunk = pipe.read(65536)
        if not chunk:
            break
        total += len(chunk)
        if len(kept) < cap:
            kept += chunk[: cap - len(kept)]
    out[:] = [bytes(kept), total > cap]


def run_python(code: str, limits: Optional[SandboxLimits] = None, python: Optional[str] = None) -> SandboxResult:
    """Run ``code`` in a fresh sandboxed interpreter (see the module docstring). ``python``: the
    interpreter (default: the one under this process's venv, whose site-packages ``-I`` leaves out)."""
    lim = limits or SandboxLimits()
    prefix = namespace_prefix()
    drop = os.geteuid() == 0 and "--user" not in prefix
    python = python or sandbox_python(drop)
    work = tempfile.mkdtemp(prefix="glm5-sandbox-")
    try:
        if drop:
            os.chown(work, NOBODY, NOBODY)
        spec = {"work": work, "limits": asdict(lim), "drop": drop, "private_tmp": bool(prefix),
                "python": python}
        env = {"PATH": "/usr/bin:/bin", "HOME": work, "TMPDIR": work, "LANG": "C.UTF-8",
               "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        cmd = [*prefix, sys.executable, "-I", os.path.abspath(__file__), json.dumps(spec)]
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             cwd=work, env=env, start_new_session=True)
        outs: list[list] = [[], []]
        readers = [threading.Thread(target=_drain, args=(s, lim.max_output_bytes, o), daemon=True)
                   for s, o in ((p.stdout, outs[0]), (p.stderr, outs[1]))]
        for r in readers:
            r.start()
        try:
            p.stdin.write(code.encode("utf-8", "replace"))
            p.stdin.close()
        except BrokenPipeError:
            pass
        timed_out = False
        try:
            p.wait(timeout=lim.wall_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        _kill_tree(p)
        for r in readers:
            r.join(5)
        wall = time.perf_counter() - t0
        rc = p.returncode
        (out, out_cut), (err, err_cut) = (o if o else [b"", False] for o in outs)
        status = "timeout" if timed_out else "ok" if rc == 0 else "killed" if rc is not None and (
            rc < 0 or rc > 128) else "error"
        return SandboxResult(status, rc, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), wall,
                             out_cut or err_cut, bool(prefix))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _kill_tree(p: subprocess.Popen) -> None:
    """SIGKILL the call's process group (with namespaces: PID 1 dies, and the kernel kills the rest)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        p.wait(5)
    except subprocess.TimeoutExpired:
        pass


def _limit(lim: dict) -> None:
    mb = 1024 * 1024
    for what, value in ((resource.RLIMIT_CPU, (lim["cpu_s"], lim["cpu_s"] + 1)),
                        (resource.RLIMIT_AS, (lim["memory_mb"] * mb,) * 2),
                        (resource.RLIMIT_FSIZE, (lim["file_mb"] * mb,) * 2),
                        (resource.RLIMIT_NPROC, (lim["processes"],) * 2),
                        (resource.RLIMIT_NOFILE, (lim["open_files"],) * 2),
                        (resource.RLIMIT_CORE, (0, 0))):
        resource.setrlimit(what, value)


def _boot(spec: dict) -> int:
    """PID 1 of the call's namespaces: private tmpfs mounts, then fork the limited interpreter."""
    work = os.open(spec["work"], os.O_RDONLY | os.O_DIRECTORY)
    if spec["private_tmp"]:
        for d in PRIVATE_TMP:
            if os.path.isdir(d):
                subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=1777", "tmpfs", d], check=True,
                               capture_output=True)
    code = sys.stdin.buffer.read()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(w)
        os.dup2(r, 0)
        os.fchdir(work)  # the call's folder (its path may be under a /tmp now hidden by the tmpfs)
        if spec["drop"]:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
        _limit(spec["limits"])
        os.execve(spec["python"], [spec["python"], "-I", "-"], dict(os.environ))
    os.close(r)
    os.write(w, code)
    os.close(w)
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except ChildProcessError:
            return 1
        except InterruptedError:
            continue
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


if __name__ == "__main__":
    sys.exit(_boot(json.loads(sys.argv[1])))

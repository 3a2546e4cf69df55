"""A Python sandbox for tool episodes: one fresh interpreter per call, on bubblewrap, under limits that hold
for the whole call.

``run_python(code, limits)`` runs ``code`` (sent on stdin) in a call of its own:

- **what it sees** (``rl.tasks.sandbox_root``): a read-only root holding only the interpreter, its standard
  library and the libraries they load; its own ``/proc`` (PID namespace), a minimal ``/dev``, no network
  (a network namespace of its own), no host path (no ``/etc``, ``/srv``, ``/run``, ``/home``, the project,
  the data, the model), and two private writable tmpfs of ``disk_mb`` each (``/tmp``, its working folder,
  and ``/dev/shm``) that vanish with the call;
- **who it is**: uid 1000 without capabilities in a user namespace of its own, which maps to — as root —
  a uid of its own per call (``UID_BASE`` + pid · 64 + slot, dropped to with ``setpriv`` before bubblewrap
  starts; no two running calls share one), or — not root — this process's uid;
- **whole-call limits** (``rl.tasks.sandbox_cgroup``: a cgroup per call, v2 or v1): ``memory_mb`` for all
  its processes and its tmpfs together (an out-of-memory kill), ``processes`` at once (a fork past it
  fails), ``cpu_s`` CPU seconds of all its processes (the call is killed), ``wall_s`` (killed); per
  process also ``RLIMIT_AS`` = ``memory_mb`` (a large allocation raises ``MemoryError``),
  ``RLIMIT_FSIZE`` = ``file_mb``, ``RLIMIT_NOFILE``, ``RLIMIT_NPROC``, no core dumps; stdout / stderr kept
  up to ``max_output_bytes`` each (the rest is read and dropped);
- **the end**: when the interpreter exits, or a limit stops the call, every process of the call is killed
  (its PID namespace ends with bubblewrap; the cgroup is emptied with SIGKILL and removed).

``SandboxResult.status``: ``ok`` (exit 0), ``error`` (non-zero exit: an exception, ``MemoryError``),
``killed`` (a signal, or a whole-call limit: ``limit`` names it) or ``timeout`` (wall clock).

Full isolation needs bubblewrap, user namespaces, a cgroup for the call (root, or a delegated cgroup v2:
``GLM5_SANDBOX_CGROUP``) and, as root, ``setpriv``. ``isolation()`` checks once per process, with a real
call; where anything is missing ``run_python`` raises ``SandboxUnavailable`` naming it — it never runs the
code with less isolation. ``Isolation.line`` is what the calls run under (the run's log prints it).
"""

from __future__ import annotations

import itertools
import math
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, fields
from functools import lru_cache
from typing import Optional

from rl.tasks.sandbox_cgroup import CallGroup, Layout, find_layout
from rl.tasks.sandbox_root import STARTED, bwrap_command, root_args, sandbox_python

UID_BASE = 0x70000000
SLOTS = 64
"""Calls one process may run at once (each gets its own uid as root)."""
LAUNCH = 'while [ "$1" != -- ]; do echo $$ > "$1" || exit 125; shift; done; shift; exec "$@"'
"""The call's first process: into the call's cgroup(s), then the rest of the call."""
POLL_S = 0.02
MIN_BWRAP = (0, 8)
"""bubblewrap 0.8 (Debian 12): ``--size`` (the tmpfs quota) and ``--disable-userns``."""


class SandboxUnavailable(ValueError):
    """This machine cannot isolate tool code fully (the message says what is missing)."""


class SandboxError(RuntimeError):
    """A call's sandbox could not be set up or torn down (not the code's fault)."""


@dataclass
class SandboxLimits:
    cpu_s: float = 5.0
    """CPU seconds of all the call's processes together (and RLIMIT_CPU of each)."""
    memory_mb: int = 1024
    """Memory of all the call's processes and its tmpfs together (and RLIMIT_AS of each)."""
    file_mb: int = 16
    """Largest file a process may write (RLIMIT_FSIZE)."""
    disk_mb: int = 64
    """Size of each writable tmpfs (/tmp, /dev/shm); counted in memory_mb as it fills."""
    processes: int = 64
    """Processes of the call at once, the interpreter included (the cgroup's ``pids.max`` adds bubblewrap's
    two)."""
    open_files: int = 64
    wall_s: float = 10.0
    max_output_bytes: int = 65536

    MINIMUM = {"cpu_s": 0.0, "memory_mb": 64, "file_mb": 1, "disk_mb": 1, "processes": 1, "open_files": 16,
               "wall_s": 0.0, "max_output_bytes": 1}
    """Lowest values (exclusive for the floats): the interpreter needs ~40 MB of address space and ~10 files."""

    @classmethod
    def from_kwargs(cls, kwargs: dict, field: str = "rollout.multi_turn.env_kwargs") -> "SandboxLimits":
        """The limits from ``env_kwargs``; an unknown key, a wrong type or a value out of range is a
        ValueError naming ``field`` and the key."""
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(kwargs) - set(known))
        if unknown:
            raise ValueError(f"{field}: unknown sandbox limit(s) {unknown}; the limits are {sorted(known)}")
        for k, v in kwargs.items():
            floaty, lo = known[k].type == "float", cls.MINIMUM[k]
            if isinstance(v, bool) or not isinstance(v, (int, float) if floaty else int):
                raise ValueError(f"{field}.{k}={v!r}: expected {'a number' if floaty else 'an integer'}")
            if floaty and not math.isfinite(v) or (v <= lo if floaty else v < lo):
                raise ValueError(f"{field}.{k}={v!r}: must be {'finite and > ' if floaty else '>= '}{lo}")
        return cls(**kwargs)

    def rlimits(self) -> str:
        """The per-process limits for ``sandbox_root.BOOT`` (AS, CPU, FSIZE, NOFILE, NPROC, CORE). The
        whole-call CPU limit acts first; RLIMIT_CPU (1 s later) stops a process the poll would miss."""
        cpu = math.ceil(self.cpu_s) + 1
        mb = 1024 * 1024
        pairs = [(self.memory_mb * mb,) * 2, (cpu, cpu + 1), (self.file_mb * mb,) * 2, (self.open_files,) * 2,
                 (self.processes + 1,) * 2, (0, 0)]  # NPROC: bubblewrap's init in the call's namespace too
        return ",".join(f"{s}:{h}" for s, h in pairs)


@dataclass
class SandboxResult:
    status: str
    returncode: Optional[int]
    stdout: str
    stderr: str
    wall_s: float
    truncated: bool = False
    limit: str = ""
    """The whole-call limit that stopped the call: ``cpu``, ``memory``, ``wall`` (or "")."""
    cpu_s: float = 0.0
    forks_refused: int = 0


@dataclass(frozen=True)
class Isolation:
    ok: bool
    line: str
    """What the calls run under, or what is missing."""


class _Slots:
    def __init__(self):
        self.free, self.cv = set(range(SLOTS)), threading.Condition()

    def take(self) -> int:
        with self.cv:
            self.cv.wait_for(lambda: self.free)
            return self.free.pop()

    def give(self, slot: int) -> None:
        with self.cv:
            self.free.add(slot)
            self.cv.notify()


_SLOTS = _Slots()
_CALLS = itertools.count()


def _drain(pipe, cap: int, out: list, skip: bytes) -> None:
    """Read ``pipe`` to its end, keeping ``cap`` bytes: out = [kept, cut, began with ``skip`` (taken off)]."""
    kept, total, head, found = bytearray(), 0, b"", False
    pending = bool(skip)  # still reading the first len(skip) bytes
    while True:
        chunk = pipe.read(65536)
        if not chunk:
            break
        if pending:
            head += chunk
            if len(head) < len(skip) and skip.startswith(head):
                continue
            found, pending = head.startswith(skip), False
            chunk = head[len(skip):] if found else head
        total += len(chunk)
        if len(kept) < cap:
            kept += chunk[: cap - len(kept)]
    if pending:  # ended inside what could have been the marker: output after all
        kept, total = bytearray(head[:cap]), len(head)
    out[:] = [bytes(kept), total > cap, found]


def _tools(own_uid: bool) -> tuple[Optional[str], Optional[str], str]:
    """(bwrap, setpriv, what is missing or "")."""
    bwrap, setpriv = shutil.which("bwrap"), shutil.which("setpriv")
    if bwrap is None:
        return None, None, ("bubblewrap (bwrap) is not installed (Debian / Ubuntu: apt-get install bubblewrap; "
                            "./setup.sh does it when run as root)")
    if own_uid and setpriv is None:
        return bwrap, None, "setpriv (util-linux) is not installed: as root each call drops to a uid of its own with it"
    return bwrap, setpriv, ""


def _launch(layout: Layout, code: str, lim: SandboxLimits, python: Optional[str]) -> SandboxResult:
    """One call (see the module docstring); assumes ``isolation()`` found the tools."""
    own_uid = os.geteuid() == 0
    bwrap, setpriv, missing = _tools(own_uid)
    if missing:
        raise SandboxUnavailable(missing)
    python = python or sandbox_python(own_uid)
    slot = _SLOTS.take()
    group = None
    try:
        group = CallGroup(layout, f"call-{os.getpid()}-{slot}-{next(_CALLS)}", lim.memory_mb, lim.processes + 2)
        cmd = ["/bin/sh", "-c", LAUNCH, "sh", *group.procs, "--"]
        if own_uid:
            uid = str(UID_BASE + os.getpid() * SLOTS + slot)
            cmd += [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--no-new-privs"]
        cmd += bwrap_command(bwrap, python, lim.rlimits(), lim.disk_mb)
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/",
                             env={"PATH": "/usr/bin:/bin"}, start_new_session=True)
        outs: list[list] = [[], []]
        readers = [threading.Thread(target=_drain, args=(s, lim.max_output_bytes, o, skip), daemon=True)
                   for s, o, skip in ((p.stdout, outs[0], b""), (p.stderr, outs[1], STARTED))]
        for t in readers:
            t.start()
        try:
            p.stdin.write(code.encode("utf-8", "replace"))
            p.stdin.close()
        except BrokenPipeError:
            pass
        limit, deadline = "", t0 + lim.wall_s
        while True:
            try:
                p.wait(timeout=max(0.0, min(POLL_S, deadline - time.perf_counter())))
                break
            except subprocess.TimeoutExpired:
                pass
            if time.perf_counter() >= deadline:
                limit = "wall"
                break
            if group.cpu_s() > lim.cpu_s:
                limit = "cpu"
                break
        try:
            os.killpg(p.pid, signal.SIGKILL)  # bubblewrap: its PID namespace, and every process in it, ends
        except (ProcessLookupError, PermissionError):
            pass
        emptied = group.kill()
        p.wait()
        for t in readers:
            t.join(5)
        wall = time.perf_counter() - t0
        (out, out_cut, _), (err, err_cut, started) = (o if o else [b"", False, False] for o in outs)
        rc, oom, cpu, refused = p.returncode, group.oom_kills(), group.cpu_s(), group.forks_refused()
    finally:
        left = group.remove() if group is not None else None
        _SLOTS.give(slot)
    if not emptied or left:
        raise SandboxError(f"sandbox: processes of the call outlived it ({left or 'cgroup not empty'})")
    stderr = err.decode("utf-8", "replace")
    if not started and not limit:
        why = stderr.strip().splitlines()[-1] if stderr.strip() else f"exit code {rc}"
        raise SandboxError(f"sandbox: the call did not start ({why})")
    if oom and not limit:  # the kernel killed a process of the call for memory_mb
        limit = "memory"
    if limit == "wall":
        status = "timeout"
    elif limit == "cpu" or rc < 0 or rc > 128:
        status = "killed"
    else:
        status = "ok" if rc == 0 else "error"
    return SandboxResult(status, rc, out.decode("utf-8", "replace"), stderr, wall, out_cut or err_cut, limit, cpu,
                         refused)


def probe() -> Isolation:
    """Check, with one real call, that this machine can run tool code fully isolated (uncached:
    ``isolation`` caches it)."""
    own_uid = os.geteuid() == 0
    bwrap, _, missing = _tools(own_uid)
    if missing:
        return Isolation(False, missing)
    tool = subprocess.run([bwrap, "--version"], capture_output=True, text=True).stdout.strip() or "bubblewrap ?"
    version = tuple(int(x) for x in re.findall(r"\d+", tool)[:2])
    if version < MIN_BWRAP:
        return Isolation(False, f"{tool} is older than {'.'.join(map(str, MIN_BWRAP))} (needed: --size for the call's "
                                "tmpfs quota, --disable-userns); install a newer bubblewrap")
    layout = find_layout()
    if isinstance(layout, str):
        return Isolation(False, f"no cgroup for whole-call limits ({layout})")
    try:
        python = sandbox_python(own_uid)
        _, py_version = root_args(python)
        res = _launch(layout, "print(6 * 7)", SandboxLimits(wall_s=30, cpu_s=10), python)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return Isolation(False, f"bubblewrap could not start a sandbox here: {e}")
    if (res.status, res.stdout) != ("ok", "42\n"):
        return Isolation(False, f"bubblewrap could not start a sandbox here ({res.status}: "
                                f"{res.stderr.strip()[-300:]})")
    who = "a uid of its own per call (root)" if own_uid else f"uid {os.geteuid()} (this user)"
    return Isolation(True, f"{tool}: user, pid, net, mount, ipc, uts namespaces; read-only root of {python} "
                           f"(Python {py_version}) and its standard library; as {who}; whole-call limits by "
                           f"{layout.describe()}")


@lru_cache(maxsize=None)
def isolation() -> Isolation:
    """``probe()``, once per process."""
    return probe()


def run_python(code: str, limits: Optional[SandboxLimits] = None, python: Optional[str] = None) -> SandboxResult:
    """Run ``code`` in a fresh sandboxed interpreter (see the module docstring); ``SandboxUnavailable``
    where the machine cannot isolate it. ``python``: the interpreter (default: ``sandbox_root.sandbox_python``)."""
    iso = isolation()
    if not iso.ok:
        raise SandboxUnavailable(f"the Python sandbox cannot isolate tool code on this machine: {iso.line}")
    return _launch(find_layout(), code, limits or SandboxLimits(), python)

"""One cgroup per sandbox call (``rl.tasks.sandbox``): the call's memory, process count and CPU time are
counted for all of its processes together, so a call that forks cannot multiply its limits, and two calls
never share one.

``find_layout()`` looks at what the machine offers, once per process:

- **cgroup v2** (``cgroup2`` in ``/proc/self/mountinfo``) with the ``memory`` and ``pids`` controllers: the
  calls go under ``$GLM5_SANDBOX_CGROUP`` (a delegated, empty cgroup, e.g. one ``systemd-run --user --scope
  -p Delegate=yes`` made) or, when this process can make children with those controllers there, under
  ``glm5-sandbox/`` in its own cgroup. Limits: ``memory.max`` (+ ``memory.swap.max=0``, and
  ``memory.oom.group=1``: an out-of-memory kill takes the whole call), ``pids.max``; CPU time from
  ``cpu.stat``; ``cgroup.kill`` ends every process at once.
- **cgroup v1** (separate ``memory``, ``pids`` and ``cpuacct`` hierarchies, as on this project's Debian
  machines): one folder per call in each, under ``glm5-sandbox/`` in this process's own group of that
  hierarchy (so a limit put on this process still holds over its calls). Limits: ``memory.limit_in_bytes``
  and ``memory.memsw.limit_in_bytes`` (swap included where the kernel counts it), ``pids.max``; CPU time
  from ``cpuacct.usage``.

Otherwise it returns the reason (a string), and the sandbox refuses to run (never a call without whole-call
limits). ``CallGroup`` is one call's group: made with its limits, entered by the call's first process
(``procs``: the files it writes its pid into before anything else runs), read (``cpu_s``, ``oom_kills``,
``forks_refused``), killed and removed. Folders of processes that died without removing theirs (a killed
worker) are removed the next time a process finds the layout.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional, Union

ENV = "GLM5_SANDBOX_CGROUP"
PARENT = "glm5-sandbox"
V1_CONTROLLERS = ("memory", "pids", "cpuacct")
MB = 1024 * 1024


@dataclass(frozen=True)
class Layout:
    version: int
    parents: tuple[tuple[str, str], ...]
    """(controller, the folder the calls' groups go in); v2: one entry, controller ""."""

    def describe(self) -> str:
        where = ", ".join(sorted({p for _, p in self.parents}))
        what = "memory, pids, cpu" if self.version == 2 else "memory, pids, cpuacct"
        return f"cgroup v{self.version} ({what}) under {where}"


def _mounts() -> list[tuple[str, str, str, set]]:
    """(mount point, mount root, fstype, super options) of every cgroup mount of this process."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(rfields) >= 3 and rfields[0] in ("cgroup", "cgroup2"):
                out.append((fields[4], fields[3], rfields[0], set(rfields[2].split(","))))
    return out


def _own_groups() -> dict[str, str]:
    """{controller or "" (v2): this process's group path} from ``/proc/self/cgroup``."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            for c in ctrls.split(",") if ctrls else [""]:
                out[c] = path
    return out


def _join(mount: str, root: str, path: str) -> str:
    if root != "/" and path.startswith(root):
        path = path[len(root):]
    return os.path.join(mount, path.lstrip("/"))


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def _ensure_dir(path: str) -> None:
    try:
        os.mkdir(path)
    except FileExistsError:
        pass


def _v2(mounts, own) -> Union[Layout, str]:
    v2 = [m for m in mounts if m[2] == "cgroup2"]
    if not v2:
        return "no cgroup v2 mount"
    mount, root = v2[0][0], v2[0][1]
    given = os.environ.get(ENV)
    base = given or _join(mount, root, own.get("", "/"))
    try:
        have = set(_read(os.path.join(base, "cgroup.controllers")).split())
    except OSError as e:
        return f"cgroup v2: cannot read {base}/cgroup.controllers ({e.strerror})"
    if not {"memory", "pids"} <= have:
        return f"cgroup v2: {base} offers the controllers {sorted(have) or 'none'}, not memory and pids"
    try:
        _write(os.path.join(base, "cgroup.subtree_control"), "+memory +pids")
        parent = base
        if not given:  # our own group: the calls go in a folder of their own beneath it
            parent = os.path.join(base, PARENT)
            _ensure_dir(parent)
            _write(os.path.join(parent, "cgroup.subtree_control"), "+memory +pids")
    except OSError as e:
        why = "it holds processes" if e.errno == 16 else e.strerror
        return (f"cgroup v2: cannot give the memory and pids controllers to groups under {base} ({why}); "
                f"set {ENV} to an empty cgroup delegated to this user (e.g. made by systemd-run -p Delegate=yes)")
    return Layout(2, (("", parent),))


def _v1(mounts, own) -> Union[Layout, str]:
    parents = []
    for c in V1_CONTROLLERS:
        found = [m for m in mounts if m[2] == "cgroup" and c in m[3]]
        if not found:
            return f"cgroup v1: no {c} hierarchy mounted"
        mount, root = found[0][0], found[0][1]
        parent = os.path.join(_join(mount, root, own.get(c, "/")), PARENT)
        try:
            _ensure_dir(parent)
            probe = os.path.join(parent, f"probe-{os.getpid()}")
            _ensure_dir(probe)
            os.rmdir(probe)
        except OSError as e:
            return f"cgroup v1: cannot make groups under {parent} ({e.strerror}; run as root or use cgroup v2 delegation)"
        parents.append((c, parent))
    return Layout(1, tuple(parents))


@lru_cache(maxsize=None)
def find_layout() -> Union[Layout, str]:
    """The machine's per-call cgroup layout (see the module docstring), or why there is none."""
    try:
        mounts, own = _mounts(), _own_groups()
    except OSError as e:
        return f"cannot read this process's cgroups ({e})"
    why = []
    for find in (_v2, _v1):
        got = find(mounts, own)
        if isinstance(got, Layout):
            _remove_stale(got)
            return got
        why.append(got)
    return "; ".join(why)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _remove_stale(layout: Layout) -> None:
    """Groups of calls whose process is gone (killed mid-call) and that hold no process now."""
    for _, parent in layout.parents:
        try:
            names = os.listdir(parent)
        except OSError:
            continue
        for name in names:
            parts = name.split("-")
            if parts[0] == "call" and len(parts) > 1 and parts[1].isdigit() and not _pid_alive(int(parts[1])):
                try:
                    os.rmdir(os.path.join(parent, name))
                except OSError:
                    pass


class CallGroup:
    """One call's cgroup(s) under ``layout`` with the call's limits written (see the module docstring)."""

    def __init__(self, layout: Layout, name: str, memory_mb: int, processes: int):
        self.layout = layout
        self.dirs = {ctrl: os.path.join(parent, name) for ctrl, parent in layout.parents}
        self.made: list[str] = []
        try:
            for d in dict.fromkeys(self.dirs.values()):
                os.mkdir(d)
                self.made.append(d)
            limit = str(memory_mb * MB)
            if layout.version == 2:
                d = self.dirs[""]
                _write(os.path.join(d, "memory.max"), limit)
                for f, v in (("memory.swap.max", "0"), ("memory.oom.group", "1")):
                    if os.path.exists(os.path.join(d, f)):
                        _write(os.path.join(d, f), v)
                _write(os.path.join(d, "pids.max"), str(processes))
            else:
                m = self.dirs["memory"]
                _write(os.path.join(m, "memory.limit_in_bytes"), limit)
                if os.path.exists(os.path.join(m, "memory.memsw.limit_in_bytes")):
                    _write(os.path.join(m, "memory.memsw.limit_in_bytes"), limit)
                _write(os.path.join(self.dirs["pids"], "pids.max"), str(processes))
        except BaseException:
            self.remove()
            raise
        self.procs = [os.path.join(d, "cgroup.procs") for d in self.made]
        """Files the call's first process writes its pid into (it then execs the rest of the call)."""

    def _dir(self, ctrl: str) -> str:
        return self.dirs["" if self.layout.version == 2 else ctrl]

    def cpu_s(self) -> float:
        """CPU seconds (user + system) used by every process of the call so far."""
        try:
            if self.layout.version == 2:
                for line in _read(os.path.join(self.dirs[""], "cpu.stat")).splitlines():
                    if line.startswith("usage_usec "):
                        return int(line.split()[1]) / 1e6
                return 0.0
            return int(_read(os.path.join(self.dirs["cpuacct"], "cpuacct.usage"))) / 1e9
        except (OSError, ValueError):
            return 0.0

    def _counter(self, ctrl: str, file: str, key: str) -> int:
        try:
            for line in _read(os.path.join(self._dir(ctrl), file)).splitlines():
                k, _, v = line.partition(" ")
                if k == key:
                    return int(v)
        except (OSError, ValueError):
            pass
        return 0

    def oom_kills(self) -> int:
        """Processes of the call the kernel killed for its memory limit."""
        if self.layout.version == 2:
            return self._counter("memory", "memory.events", "oom_kill")
        return self._counter("memory", "memory.oom_control", "oom_kill")

    def forks_refused(self) -> int:
        """Forks refused by the call's process limit."""
        return self._counter("pids", "pids.events", "max")

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in _read(os.path.join(self._dir("pids"), "cgroup.procs")).split()]
        except (OSError, ValueError):
            return []

    def kill(self, patience_s: float = 5.0) -> bool:
        """SIGKILL every process of the call; True once none is left."""
        kill_file = os.path.join(self._dir("pids"), "cgroup.kill")
        end = time.monotonic() + patience_s
        while True:
            left = self.pids()
            if not left:
                return True
            if time.monotonic() > end:
                return False
            if self.layout.version == 2 and os.path.exists(kill_file):
                try:
                    _write(kill_file, "1")
                except OSError:
                    pass
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.002)

    def remove(self) -> Optional[str]:
        """Remove the group's folders (after ``kill``); those that could not be removed, or None."""
        left = []
        for d in self.made:
            for _ in range(200):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.005)
            else:
                left.append(d)
        return ", ".join(left) or None

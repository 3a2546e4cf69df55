"""Calls of a user's function in worker processes, each with a wall timeout and crash isolation.

Used for reward functions (``rl.tasks.rewards.RewardScorer``) and tool environments (``rl.tasks.episodes``): the
function runs in the main thread of a worker process (so signal-based timeouts such as math-verify's
work, whatever thread the driver calls from), and a call that hangs past ``timeout_s`` or kills its
process (segfault, ``os._exit``, OOM kill) costs that call only: the worker is killed and a new one
started, and the call's ``Outcome`` says what happened. A call that raises is an ``Outcome`` with the
exception's one-line text. Workers are started with ``spawn`` (no copy of the driver's threads, Ray or
torch state) and import the function's module and, as ``spawn`` does, the driver's main module: a driver
script keeps its job under ``if __name__ == "__main__":`` (or every worker runs it again and exits 1).

Each worker leads a process group of its own, so nothing a failed call started outlives it: a timeout or
a crash SIGKILLs the worker's whole group (the worker is replaced), an error SIGKILLs the rest of the group
(the worker goes on). A function that forks and whose forked copy returns too (``os.fork()`` then
``return``) is one error, "returned twice", not two results.

``Outcome.status``: ``ok`` (``value`` set), ``timeout``, ``error`` (the function raised, or its value
could not be sent back) or ``crash`` (the process died; ``message`` names the signal or exit code).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import multiprocessing as mp
import os
import select
import signal
import time
from collections import deque
from dataclasses import dataclass
from multiprocessing.connection import wait
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, Callable, Optional


@dataclass
class Outcome:
    status: str
    value: Any = None
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def resolve(path: str, field: str = "reward.fn") -> Callable:
    """A function from ``module.function`` or ``/path/to/file.py:function`` (verl's
    ``custom_reward_function.path`` + ``name``); errors name ``field``."""
    if ".py:" in path:
        file, _, name = path.rpartition(":")
        if not Path(file).is_file():
            raise ValueError(f"{field}={path!r}: no file {file}")
        spec = importlib.util.spec_from_file_location(f"glm5_user_{Path(file).stem}", file)
        mod = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(mod)
        except Exception as e:
            raise ValueError(f"{field}={path!r}: importing {file} raised {type(e).__name__}: {e}") from None
    else:
        modname, _, name = path.rpartition(".")
        if not modname:
            raise ValueError(f"{field}={path!r}: expected a dotted path module.function or file.py:function")
        try:
            mod = importlib.import_module(modname)
        except Exception as e:
            raise ValueError(f"{field}={path!r}: cannot import ({type(e).__name__}: {e})") from None
    fn = getattr(mod, name, None)
    if not callable(fn):
        raise ValueError(f"{field}={path!r}: {name!r} is not a function of that module")
    return fn


def group_members(pgid: int) -> list[int]:
    """The pids of process group ``pgid`` (from ``/proc/*/stat``)."""
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    fields = f.read().rsplit(b")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                out.append(int(name))
    return out


def _kill_others() -> None:
    """SIGKILL every process of this worker's process group but the worker (what a failed call started)."""
    me = os.getpid()
    for pid in group_members(me):
        if pid != me:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class _Forks:
    """Forks of the worker's process made during a call (``os.fork``), counted by an at-fork hook."""
    count = 0

    @classmethod
    def hook(cls) -> None:
        cls.count += 1


def _call(fn, args: tuple, kwargs: dict, me: int, deadline: float) -> tuple[bool, Any]:
    """(ok, value | message) of one call. A forked process that comes back here (the function forked and
    both copies returned) reports on a pipe of its own and exits; the worker then waits, up to the call's
    deadline, for every such copy to report or exit, so the call is one result: an error naming the fork."""
    r, w = os.pipe()
    before = _Forks.count
    try:
        try:
            out = True, fn(*args, **kwargs)
        except BaseException as e:  # a user's function: its failure is this call's outcome
            out = False, f"{type(e).__name__}: {e}"
        if os.getpid() != me:  # a fork of the worker, returning from the function: not a second result
            os.write(w, b"x")
            os._exit(0)
        os.close(w)
        w = -1
        if _Forks.count != before:  # copies hold the pipe until they return (a byte) or exit (EOF)
            got = select.select([r], [], [], max(0.0, deadline - time.monotonic()))[0]
            if got and os.read(r, 1):
                out = False, "returned twice: it forked, and the forked copy returned from the function too"
    finally:
        if os.getpid() == me:
            os.close(r)
            if w >= 0:
                os.close(w)
    if not out[0]:
        _kill_others()  # a timeout or a crash kills the whole group from the driver (ProcessPool._replace)
    return out


def _serve(conn, path: str, field: str, kwargs: dict, timeout_s: float) -> None:
    """Worker loop: a chunk [(tid, args), ...] in, one (tid, ok, value | message) out per call as it
    finishes, until the pipe closes. The worker leads a process group of its own: what its calls start
    is in it, and dies with it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver's Ctrl-C is the driver's
    os.setpgid(0, 0)
    os.register_at_fork(after_in_parent=_Forks.hook)
    me = os.getpid()
    try:
        fn, load_error = resolve(path, field), ""
    except ValueError as e:
        fn, load_error = None, str(e)
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        start = time.monotonic()
        for tid, args in chunk:
            if fn is None:
                conn.send((tid, False, load_error))
                continue
            ok, value = _call(fn, args, kwargs, me, start + timeout_s)
            try:
                conn.send((tid, ok, value))
            except Exception as e:
                conn.send((tid, False, f"returned a value that cannot be sent back ({type(e).__name__}: {e})"))
            start = time.monotonic()


def _death(code: Optional[int]) -> str:
    if code is not None and code < 0:
        try:
            return f"its process died of {signal.Signals(-code).name}"
        except ValueError:
            return f"its process died of signal {-code}"
    return f"its process exited with code {code}"


class _Worker:
    def __init__(self, ctx, path: str, field: str, kwargs: dict, timeout_s: float):
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, path, field, kwargs, timeout_s), daemon=True,
                                name=f"glm5-{field}")
        self.proc.start()
        child.close()
        self.task: Optional[deque] = None  # the tids of the chunk in flight, in order
        self.deadline = 0.0

    def kill(self) -> None:
        """SIGKILL the worker's whole process group (the worker and whatever its calls started)."""
        try:
            if self.proc.pid is not None and os.getpgid(self.proc.pid) == self.proc.pid:
                os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class ProcessPool:
    """``workers`` processes calling ``path`` (``resolve``) with ``kwargs``; ``map`` runs a list of
    argument tuples and returns one ``Outcome`` per call, in order."""

    CHUNK = 16
    """Most calls sent to a worker at once (fewer when the batch is small, so all workers get work)."""
    IDLE_DEATHS = 4
    """Workers found dead before their chunk (killed while idle) replaced in one ``map`` before its calls are
    crash outcomes: a worker that dies on start cannot loop forever."""

    def __init__(self, path: str, workers: int, timeout_s: float, kwargs: Optional[dict] = None,
                 field: str = "reward.fn"):
        if workers < 1:
            raise ValueError(f"{field}: a process pool needs >= 1 worker")
        if not math.isfinite(timeout_s) or timeout_s <= 0:
            raise ValueError(f"{field}: timeout must be a finite number of seconds > 0 (got {timeout_s})")
        resolve(path, field)  # a bad path fails here, in the driver, with one line
        self.path, self.field, self.kwargs, self.timeout_s = path, field, dict(kwargs or {}), float(timeout_s)
        self._ctx = mp.get_context("spawn")
        self._workers = [self._spawn() for _ in range(workers)]

    def _spawn(self) -> _Worker:
        return _Worker(self._ctx, self.path, self.field, self.kwargs, self.timeout_s)

    def map(self, calls: list[tuple]) -> list[Outcome]:
        """One ``Outcome`` per call, in order. Calls go to the workers in chunks (a worker runs its chunk
        without waiting for the driver between calls); each call has its own ``timeout_s`` from the end of
        the one before it. A call that times out or kills its worker gets that outcome, the rest of its
        chunk goes back to the queue, and the worker is replaced."""
        out: list[Optional[Outcome]] = [None] * len(calls)
        todo = deque(range(len(calls)))
        size = max(1, min(self.CHUNK, len(calls) // (4 * len(self._workers))))
        dead_idle = 0
        while todo or any(w.task for w in self._workers):
            for i, w in enumerate(self._workers):
                if not w.task and todo:
                    tids = [todo.popleft() for _ in range(min(size, len(todo)))]
                    try:
                        payload = ForkingPickler.dumps([(t, calls[t]) for t in tids])
                    except Exception as e:  # arguments that cannot be pickled: each on its own
                        if len(tids) > 1:
                            todo.extendleft(reversed(tids))
                            size = 1
                        else:
                            out[tids[0]] = Outcome("error", message=f"arguments cannot be sent ({type(e).__name__}: {e})")
                        continue
                    try:
                        w.conn.send_bytes(payload)
                    except OSError:  # the worker died idle (between calls): replaced, its chunk not yet run
                        w.proc.join(5)
                        dead_idle += 1
                        if dead_idle > self.IDLE_DEATHS:
                            for t in tids:
                                out[t] = Outcome("crash", message=f"{_death(w.proc.exitcode)} before the call, "
                                                                  f"{dead_idle} workers found dead in this batch")
                        else:
                            todo.extendleft(reversed(tids))
                        self._replace(i)
                        continue
                    w.task, w.deadline = deque(tids), time.monotonic() + self.timeout_s
            busy = [w for w in self._workers if w.task]
            if not busy:
                continue
            left = min(w.deadline for w in busy) - time.monotonic()
            ready = set(wait([w.conn for w in busy] + [w.proc.sentinel for w in busy], max(left, 0)))
            for i, w in enumerate(self._workers):
                if not w.task:
                    continue
                failed = None
                if w.conn in ready:
                    try:
                        while w.task and w.conn.poll():
                            tid, ok, payload = w.conn.recv()
                            w.task.popleft()
                            out[tid] = Outcome("ok", payload) if ok else Outcome("error", message=str(payload))
                            w.deadline = time.monotonic() + self.timeout_s
                    except (EOFError, OSError):
                        w.proc.join(5)
                        failed = Outcome("crash", message=_death(w.proc.exitcode))
                elif w.proc.sentinel in ready:
                    w.proc.join(5)
                    failed = Outcome("crash", message=_death(w.proc.exitcode))
                elif time.monotonic() >= w.deadline:
                    failed = Outcome("timeout", message=f"no result after {self.timeout_s:g} s")
                if failed is not None and w.task:
                    out[w.task.popleft()] = failed
                    todo.extendleft(reversed(w.task))
                    self._replace(i)
        return out  # type: ignore[return-value]

    def _replace(self, i: int) -> None:
        self._workers[i].kill()
        self._workers[i] = self._spawn()

    def close(self) -> None:
        for w in self._workers:
            w.kill()
        self._workers = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


"""The engine's channel to ``rl.rollout.vllm_server.Server``: in this process (``LocalServer``) or in a child
process under another interpreter (``RemoteServer``, vLLM's own environment), behind one interface:
``call(method, *args, **kwargs)`` (one at a time, answered) and ``notify(method, *args)`` (unanswered, from
another thread while a ``call`` waits: ``interrupt``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


class RemoteServer:
    """``vllm_server.Server`` in a child process under another Python; same methods via ``call``."""

    def __init__(self, python: str, args: tuple, kwargs: dict, env: dict, start_timeout: float = 900.0):
        from multiprocessing.connection import Listener

        if not Path(python).is_file():
            raise FileNotFoundError(f"vllm_python={python}: no such interpreter (CPU tests: ./setup_vllm_cpu.sh)")
        key = os.urandom(16)
        self._dir = tempfile.mkdtemp(prefix="glm5_vllm_sock_")
        address = os.path.join(self._dir, "socket")
        self._listener = Listener(address, family="AF_UNIX", authkey=key)
        child_env = {k: v for k, v in os.environ.items()  # the trainer's process group is not vLLM's
                     if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "PYTHONPATH",
                                  "VIRTUAL_ENV", "PYTHONHOME")}
        child_env.update(env, GLM5_VLLM_AUTHKEY=key.hex(), PYTHONPATH=str(REPO_ROOT))
        self.proc = subprocess.Popen([python, "-m", "rl.rollout.vllm_server", address], env=child_env,
                                     cwd=str(REPO_ROOT))
        got: dict = {}
        t = threading.Thread(target=lambda: got.setdefault("conn", self._listener.accept()), daemon=True)
        t.start()
        t.join(start_timeout)
        if "conn" not in got:
            self.close()
            raise RuntimeError(f"vLLM server ({python}) did not connect within {start_timeout:.0f}s")
        self.conn = got["conn"]
        self._send = threading.Lock()  # ``notify`` comes from another thread while a ``call`` waits
        self.call("init", *args, **kwargs)

    def call(self, method: str, *args, **kwargs):
        try:
            with self._send:
                self.conn.send((method, args, kwargs))
            status, result = self.conn.recv()
        except (EOFError, OSError, BrokenPipeError):
            code = self.proc.poll()
            raise RuntimeError(f"vLLM server process ended (exit code {code}) during {method}") from None
        if status != "ok":
            raise RuntimeError(f"vLLM server: {method} failed: {result}")
        return result

    def notify(self, method: str, *args) -> None:
        """A message the server's reading thread serves at once, unanswered (``interrupt``)."""
        try:
            with self._send:
                self.conn.send((method, args, {}))
        except (OSError, BrokenPipeError):
            pass  # the server is gone: the call in flight says so

    def close(self) -> None:
        conn = getattr(self, "conn", None)
        if conn is not None and self.proc.poll() is None:
            try:
                conn.send(("close", (), {}))
                conn.recv()
            except (EOFError, OSError):
                pass
        if self.proc.poll() is None:
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class LocalServer:
    """``vllm_server.Server`` in this process, behind the same ``call`` as ``_RemoteServer``."""

    def __init__(self, server):
        self.server = server

    def call(self, method: str, *args, **kwargs):
        return getattr(self.server, method)(*args, **kwargs)

    def notify(self, method: str, *args) -> None:
        getattr(self.server, method)(*args)

    def close(self) -> None:
        self.server = None

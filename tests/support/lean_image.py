"""A child process that sees what the lent GPU image offers (``docs/gpu.md``): no Ray, and TileLang importable
(a stand-in package) — ``lean_env(tmp)`` is the environment for it: a ``sitecustomize`` that hides Ray from
the path finder (``import ray`` and ``importlib.util.find_spec("ray")`` say it is not installed) and a
``tilelang`` package that imports."""

from __future__ import annotations

from pathlib import Path

from tests.support.launch import child_env

SITECUSTOMIZE = '''import importlib.machinery
import sys


class _NoRay(importlib.machinery.PathFinder):
    """The lent image has no Ray: the path finder does not see it."""

    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            return None
        return super().find_spec(name, path, target)


sys.meta_path[:] = [_NoRay if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
'''


def lean_env(tmp: Path, **extra: str) -> dict:
    (tmp / "tilelang").mkdir(parents=True, exist_ok=True)
    (tmp / "tilelang" / "__init__.py").write_text('__version__ = "0.0+stand-in"\n')
    (tmp / "sitecustomize.py").write_text(SITECUSTOMIZE)
    env = child_env(**extra)
    env["PYTHONPATH"] = f"{tmp}:{env['PYTHONPATH']}"
    return env

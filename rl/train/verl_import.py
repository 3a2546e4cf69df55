"""verl's RL math importable without Ray (the lent GPU image: no Ray, no registry, 64 MiB of carried wheels; Ray's
wheel is ~70 MB alone).

verl 0.9.1 imports Ray at package import (``verl/__init__.py:32`` → ``protocol.py:29 import ray``) and again under
``verl.workers.config`` (``workers/config/actor.py:22`` → ``utils/profiler/profile.py:443`` →
``single_controller/base``), though none of the functions this project calls (``core_algos``' losses and
estimators, ``rollout_corr_helper``, ``seqlen_balancing``) touches Ray. ``load()``, where Ray is not installed,
imports those modules with a placeholder ``ray`` on ``sys.meta_path`` for the duration of the import: every name
taken from it is a class that raises ``ModuleNotFoundError`` when called or instantiated, so verl's module-level
decorators and type hints resolve and any real use of Ray still fails loudly. The placeholder is then removed
(finder and ``sys.modules`` entries), so ``import ray`` and ``importlib.util.find_spec("ray")`` elsewhere say
"not installed" as before. With Ray installed ``load()`` only imports verl.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

MODULES = ("verl.trainer.ppo.core_algos", "verl.trainer.ppo.rollout_corr_helper", "verl.utils.seqlen_balancing",
           "verl.workers.config.actor")
"""The verl modules this project's RL math imports."""

ABSENT = "Ray is not installed here: verl's RL math was imported without it (rl.train.verl_import)"


def _absent(name: str):
    class Absent:
        def __init__(self, *a, **kw):
            raise ModuleNotFoundError(f"{name}: {ABSENT}")

        def __class_getitem__(cls, item):
            return cls

        def __call__(self, *a, **kw):  # pragma: no cover - instances are never made
            raise ModuleNotFoundError(f"{name}: {ABSENT}")

    Absent.__name__ = Absent.__qualname__ = name.rsplit(".", 1)[-1]
    return Absent


class _Placeholder(types.ModuleType):
    def __getattr__(self, key: str):
        if key.startswith("__"):
            raise AttributeError(key)
        return _absent(f"{self.__name__}.{key}")


class _RayFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _Placeholder(spec.name)
        mod.__path__ = []
        return mod

    def exec_module(self, module) -> None:
        pass


def ray_installed() -> bool:
    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):  # a broken or half-removed install
        return False


def prepare() -> None:
    """Called where the project's RL math imports verl (``rl.train.algos``, ``rl.train.micro_batch``,
    ``rl.validate``): with Ray installed nothing (verl is imported where it is used); without it ``load()`` now,
    so those modules' ``from verl... import`` find the modules in ``sys.modules``."""
    if not ray_installed():
        load()


def load() -> None:
    """Import ``MODULES`` (once; a no-op after the first call)."""
    if all(m in sys.modules for m in MODULES):
        return
    if ray_installed():
        for m in MODULES:
            importlib.import_module(m)
        return
    import transformers  # noqa: F401 - imported first: its optional-package probes must not see the placeholder

    finder = _RayFinder()
    sys.meta_path.insert(0, finder)
    try:
        for m in MODULES:
            importlib.import_module(m)
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n == "ray" or n.startswith("ray.")]:
            if isinstance(sys.modules[name], _Placeholder):
                del sys.modules[name]

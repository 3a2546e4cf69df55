"""Import shims for running Megatron-Bridge 0.6.2 on CPU in the side environment (manual check only).

Bridge needs Python >= 3.12 (``typing.override``) and imports Transformer Engine at module level
(``peft/lora_layers.py``) even on paths that never run a TE kernel. Megatron-Core is imported first so
its own TE probes find none; then ``transformer_engine`` is a stub whose attributes are inert classes.
Modules only its data / multimodal paths use (``BRIDGE_STUBS``) are stubbed the same way.
"""
import importlib.machinery
import os
import sys
import types
import typing

import typing_extensions

if not hasattr(typing, "override"):
    typing.override = typing_extensions.override

import megatron.core  # noqa: E402,F401
import megatron.core.models.gpt  # noqa: E402,F401
import megatron.core.tensor_parallel  # noqa: E402,F401


class _Inert(type):
    def __getattr__(cls, a):
        if a.startswith("__"):
            raise AttributeError(a)
        return _Inert(a, (), {})


def _stub(name: str) -> types.ModuleType:
    m = types.ModuleType(name)
    m.__version__ = "0.0.0"
    m.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    m.__path__ = []

    def attr(a):
        if a.startswith("__"):
            raise AttributeError(a)
        return _Inert(a, (), {})

    m.__getattr__ = attr
    return m


for _n in ("transformer_engine", "transformer_engine.pytorch",
           *os.environ.get("BRIDGE_STUBS", "datasets,megatron.energon,PIL").split(",")):
    if _n:
        sys.modules.setdefault(_n, _stub(_n))
sys.modules["transformer_engine"].pytorch = sys.modules["transformer_engine.pytorch"]

"""The network on Megatron-Core specs: ``build_model`` (``model.build``) on the groups ``init_parallel``
(``model.parallel``) makes, ``forward_logits`` for full-vocabulary logits. Only this package's names.

They resolve on first use (PEP 562), so a light submodule (``model.fp8_linear``'s predicates, which the
planner and the RL config use) does not import Megatron-Core (~8 s) into the RL driver or a CLI that only
plans or validates."""

from importlib import import_module

__all__ = ["build_model", "forward_logits", "init_parallel"]
_HOME = {"build_model": "glm5_mcore.model.build", "forward_logits": "glm5_mcore.model.build",
         "init_parallel": "glm5_mcore.model.parallel"}


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'glm5_mcore.model' has no attribute {name!r}")
    return getattr(import_module(_HOME[name]), name)

"""A flag switched on many modules for the length of a block, each one's own value put back on leaving
(``model.dsa.keeping_topk``: the cores hold their top-k; ``lora.apply.disable_adapters``: the base model
runs alone)."""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator


@contextlib.contextmanager
def switched(objs: Iterable, name: str, value: Any) -> Iterator[list]:
    """Set attribute ``name`` to ``value`` on every object of ``objs`` inside the block; on leaving (also on
    an exception) each object gets back the value it had. Yields the objects as a list."""
    objs = list(objs)
    before = [getattr(o, name) for o in objs]
    for o in objs:
        setattr(o, name, value)
    try:
        yield objs
    finally:
        for o, b in zip(objs, before):
            setattr(o, name, b)

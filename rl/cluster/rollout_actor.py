"""The rollout engine's Ray actor: ``RolloutActor`` holds one ``rollout.engine`` (``rl.rollout.base.RolloutEngine``)
and serves ``RolloutPool``'s calls — ``generate`` (or a tool-episode loop), the stream (``stream_submit`` /
``stream_poll``), adapter pushes, sleep / wake, and what the engine measured (occupancy, pushes) — with
``interrupt``, ``stream_submit`` and the measurements in a control group beside a running call."""

from __future__ import annotations

import importlib
import os
from typing import Optional

import ray

from rl.cluster.ray_jobs import node_id
from rl.rollout.base import AdapterPayload, Request, Result, SamplingParams


def load_class(path: str):
    """The class at dotted ``path`` (``rollout.engine``); an import failure is one line naming it."""
    mod, _, name = path.rpartition(".")
    try:
        return getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"rollout.engine={path!r}: cannot import ({e})") from None


@ray.remote(concurrency_groups={"control": 1})
class RolloutActor:
    def __init__(self, engine: str, hf_dir: str, deterministic_topk: bool, kwargs: dict, multi_turn=None,
                 nice: int = 0, routes_inline_bytes: int = 0):
        """``routes_inline_bytes``: ``rollout.routes_inline_bytes`` (``rl.rollout.routes.stash_routes``)."""
        self.inline = routes_inline_bytes
        if nice:
            os.nice(nice)  # see RolloutPool.CPU_NICE
        self.engine = load_class(engine)(hf_dir, deterministic_topk=deterministic_topk, **kwargs)
        self.multi_turn = multi_turn if multi_turn is not None and multi_turn.enable else None
        if self.multi_turn is not None:
            from transformers import AutoTokenizer

            from rl.tasks.episodes import ToolRunner

            self.tok = AutoTokenizer.from_pretrained(hf_dir)
            self.env = ToolRunner.from_config(multi_turn)

    def ready(self) -> bool:
        """Returns once ``__init__`` (the engine's start-up) has finished."""
        return True

    @ray.method(concurrency_group="control")
    def interrupt(self) -> bool:
        """Runs beside a ``generate`` (its own concurrency group): the engine stops at the next token
        boundary (``RolloutEngine.interrupt``); calls of the default group stay one at a time, in order."""
        return self.engine.interrupt()

    def load_adapter(self, payload: Optional[AdapterPayload]) -> dict:
        self.engine.load_adapter(payload)
        return self.engine.last_push()

    @ray.method(concurrency_group="control")
    def stream_submit(self, requests: list[Request], params: SamplingParams) -> None:
        """Beside a running ``stream_poll`` (the control group): queued requests enter freed slots at the
        next token boundary of the poll in flight."""
        self.engine.stream_submit(requests, params)

    def stream_poll(self, timeout_s: float) -> list[Result]:
        from rl.rollout.routes import stash_routes  # routes by ObjectRef (R3)

        return stash_routes(self.engine.stream_poll(timeout_s), self.inline)

    @ray.method(concurrency_group="control")
    def take_pushes(self) -> list[dict]:
        """What the engine reported of each adapter push since the last call (``RolloutEngine.pushes``)."""
        pushes = getattr(self.engine, "pushes", None)
        if not pushes:
            return []
        out, pushes[:] = list(pushes), []
        return out

    @ray.method(concurrency_group="control")
    def take_occupancy(self) -> Optional[dict]:
        """The engine's time-averaged live rows / slots since the last call (None: it does not measure)."""
        take = getattr(self.engine, "take_occupancy", None)
        return take() if take is not None else None

    def sleep(self, level: int) -> str:
        return self.engine.sleep(level)

    def wake_up(self, tags: tuple) -> str:
        return self.engine.wake_up(tuple(tags))

    def node_id(self) -> str:
        return node_id()

    def generate(self, requests: list[Request], params: SamplingParams, batched: bool) -> list[Result]:
        from rl.rollout.routes import stash_routes  # routes by ObjectRef (R3)

        if self.multi_turn is not None:
            from rl.tasks.episodes import run_episodes

            return stash_routes(run_episodes(self.engine, self.tok, self.env, requests, params, self.multi_turn,
                                             batched), self.inline)
        return stash_routes(self.engine.generate(requests, params, batched), self.inline)

"""Colocated RL: the trainer and the rollout engines time-share the same GPUs (``rollout.colocate.enable``).

The engines' actors sit in the trainer's placement-group bundles (``rl.cluster.rollout_pool``, Ray's fractional
resources), vLLM is started with sleep mode, and every generation phase of the driver
(``rl.driver.run``: a step's samples, and held-out evaluation) runs this sequence, top to bottom (after
``Colocation.start``: the engines started on memory the trainer lent out, then put to sleep):

1. the trainer offloads what only its passes need: gradient buffers, optimizer state, and the frozen
   base weights where ``rollout.colocate.offload_weights`` says (``rl.train.offload``, Megatron-Core's own
   offload calls where they exist);
2. the engines wake their weights (``wake_up(["weights"])``);
3. the newest adapter (or merged weights) is pushed: the weight sync waits for the wake-up. After a level-2
   sleep the engines kept no weights, so every wake-up pushes again — the pending payload if a new one came,
   else the one they last served (a held-out evaluation between two steps, which takes the pending push,
   leaves the next phase something to restore); verl's sharding manager syncs on every wake-up the same way;
4. the engines wake their KV cache (``wake_up(["kv_cache"])``): allocated after the push, so a merged
   push has the memory the cache will take (verl's and slime's order);
5. generation;
6. the engines sleep (``sleep_level``: 1 for a LoRARequest adapter, 2 for merged pushes);
7. the trainer restores what it offloaded; its passes (old log-probs, update, export) follow.

With engines that hold nothing worth freeing (the HF engine on CPU, vLLM-CPU, which has no sleep mode)
steps 2, 4 and 6 are still called and logged (no-ops), so the same sequence runs on a laptop. Every call
and what it reported is appended to ``trace`` (the driver returns it; tests read it).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Optional

from rl.rollout.base import AdapterPayload


def sleep_level(cfg) -> int:
    """``rollout.colocate.sleep_level``, or by push kind: merged weights change every step, so the engine
    may discard them (2) and the push brings them all back; with a LoRARequest the base never changes and
    waits in host memory (1)."""
    r = cfg.rollout
    if r.colocate.sleep_level is not None:
        return int(r.colocate.sleep_level)
    return 2 if r.engine_kwargs.get("merge") else 1


class Colocation:
    """The generation phase of colocated engines (``phase``) and the weight sync that waits for it
    (``push``). ``trainers``: ``rl.cluster.trainer_group.TrainerGroup``; ``rollouts``: ``rl.cluster.rollout_pool.RolloutPool``."""

    def __init__(self, cfg, trainers, rollouts, note=None):
        self.trainers, self.rollouts = trainers, rollouts
        self.level = sleep_level(cfg)
        self.note = note or (lambda msg: None)
        self.pending: Optional[tuple] = None
        self.served: Optional[tuple] = None
        """The payload the engines last loaded, pushed again after a sleep that discarded the weights."""
        self.discarded = False
        """The last sleep was level 2: the engines hold no weights until a push."""
        self.trace: list[dict] = []
        self.phases = 0

    @classmethod
    def start(cls, cfg, trainers, make_pool, note=None) -> "Colocation":
        """Start the engines (``make_pool()``: a ``RolloutPool`` in the trainer's bundles) on GPUs the trainer
        has lent out (vLLM sizes its KV cache from the free memory it finds), then put them to sleep: the
        trace's phase -1. verl and slime start theirs the same way."""
        self = cls(cfg, trainers, None, note)
        self.phases = -1
        self._call("trainer.offload_memory", lambda: trainers.call("offload_memory"))
        def start_pool() -> dict:
            self.rollouts = make_pool()
            return {"nodes": self.rollouts.nodes()}  # answered once every engine's constructor has run

        try:
            self._call("engines.start", start_pool)
            self._call(f"engines.sleep(level={self.level})", lambda: self.rollouts.sleep(self.level))
            self.discarded = self.level == 2
        finally:
            self._call("trainer.restore_memory", lambda: trainers.call("restore_memory"))
            self.phases = 0
        return self

    def push(self, payload: Optional[AdapterPayload]) -> None:
        """Hold ``payload`` for the next wake-up (the engines are asleep between phases)."""
        self.pending = (payload,)

    def _record(self, call: str, out, t0: float) -> None:
        self.trace.append({"phase": self.phases, "call": call, "out": out, "seconds": time.perf_counter() - t0})

    def _call(self, call: str, fn):
        t0 = time.perf_counter()
        out = fn()
        self._record(call, out, t0)
        return out

    @contextmanager
    def phase(self, what: str = "generate"):
        """Generation on the engines, the trainer's memory lent to them; ``what`` names it in the trace."""
        self._call("trainer.offload_memory", lambda: self.trainers.call("offload_memory"))
        try:
            self._call("engines.wake_up(weights)", lambda: self.rollouts.wake_up(("weights",)))
            push = self.pending or (self.served if self.discarded else None)
            if push is not None:
                payload, = push
                call = "engines.push" if self.pending is not None else "engines.push(restore)"
                self._call(call, lambda: {"version": getattr(payload, "version", None),
                                          "bytes": getattr(payload, "nbytes", 0),
                                          "engines": self.rollouts.sync(payload)})
                self.served, self.pending, self.discarded = push, None, False
            self._call("engines.wake_up(kv_cache)", lambda: self.rollouts.wake_up(("kv_cache",)))
            t0 = time.perf_counter()
            yield
            self._record(f"engines.{what}", None, t0)
            self._call(f"engines.sleep(level={self.level})", lambda: self.rollouts.sleep(self.level))
            self.discarded = self.level == 2
        finally:
            self._call("trainer.restore_memory", lambda: self.trainers.call("restore_memory"))
            self.phases += 1

    def calls(self, phase: int) -> list[str]:
        """The calls of one phase, in order."""
        return [e["call"] for e in self.trace if e["phase"] == phase]

    def metrics(self, phase: int) -> dict:
        """``colocate/*`` figures of one phase: seconds per kind of call, bytes the trainer offloaded."""
        out: dict = {}
        for e in self.trace:
            if e["phase"] != phase:
                continue
            key = e["call"].split("(")[0].replace("engines.", "engines_").replace("trainer.", "trainer_")
            out[f"colocate/{key}_s"] = out.get(f"colocate/{key}_s", 0.0) + e["seconds"]
            if e["call"] == "trainer.offload_memory":
                first = e["out"][0]
                out["colocate/offload_bytes"] = float(first["grad_bytes_freed"] + first["weight_bytes"])
        return out

"""A rollout engine that kills its own process on its first ``generate`` or stream poll with work of a run (the
first actor to get there wins an O_EXCL marker file), to test that the driver restarts it and redoes its prompts."""

import os

from rl.rollout.hf_engine import HFRolloutEngine


class DyingEngine(HFRolloutEngine):
    def __init__(self, hf_dir, deterministic_topk=True, die_marker=None, **kw):
        super().__init__(hf_dir, deterministic_topk, **kw)
        self.die_marker = die_marker

    def _die_once(self) -> None:
        if self.die_marker:
            try:
                os.close(os.open(self.die_marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                os._exit(1)  # mid-step, after the driver handed this actor its prompts

    def generate(self, requests, params, batched=True):
        self._die_once()
        return super().generate(requests, params, batched)

    def stream_poll(self, timeout_s=0.25):
        """The stream (every mode's default): dies at the first poll that finds requests submitted."""
        if self.slots.wait_for_work(timeout_s):
            self._die_once()
        return super().stream_poll(timeout_s)


class FailingEngine(HFRolloutEngine):
    """Raises in start-up, every time (a setting the engine refuses, e.g. weights it cannot open)."""

    def __init__(self, hf_dir, deterministic_topk=True, reason="cannot open the weights", **kw):
        raise ValueError(reason)


class DieOnRestartEngine(HFRolloutEngine):
    """The first ``generate`` of a run kills its process (``die_marker``, as ``DyingEngine``); every engine
    started after that dies in its own start-up (the replacement never comes up)."""

    def __init__(self, hf_dir, deterministic_topk=True, die_marker=None, **kw):
        if die_marker and os.path.exists(die_marker):
            os._exit(1)
        super().__init__(hf_dir, deterministic_topk, **kw)
        self.die_marker = die_marker

    def generate(self, requests, params, batched=True):
        os.close(os.open(self.die_marker, os.O_CREAT | os.O_WRONLY))
        os._exit(1)


class RaisingEngine(HFRolloutEngine):
    """``generate`` raises (a bug or a bad request found inside the actor)."""

    def generate(self, requests, params, batched=True):
        raise ValueError("engine says no:\nthe request is bad")

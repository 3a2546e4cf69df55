"""The rollout-engine interface: token ids in, token ids and per-token log-probs out.

Every engine returns, for each request, the sampled ``response_ids`` and ``logprobs`` =
log_softmax(logits / temperature) over the full vocabulary at the sampled token (before top-p), so
IcePop's ratio k = π_train / π_rollout compares like with like. Randomness comes only from each
request's ``seed`` (derived from step, prompt index and sample index), so a redone request — after
a restart, a resume, or on another actor — gives the same sample.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Optional

log = logging.getLogger(__name__)


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 16
    stop_token_ids: tuple = ()
    seed_per_token: bool = False
    """True: token ``t`` of a response is drawn with its own generator seeded by ``token_seed(seed, t)``
    (not a generator's running state), so a response interrupted after any token and continued from
    its prefix (``Request.prefix_ids``) samples what an uninterrupted engine would (``rl.schedule.async_source``).
    vLLM cannot reseed per token: it seeds per (sample seed, start position) instead
    (``rl.rollout.vllm_stream.request_seed``)."""


@dataclass
class Request:
    key: tuple
    """(prompt index, sample index[, generation batch]): unique within a job."""
    prompt_ids: list[int]
    seed: int
    prefix_ids: list[int] = field(default_factory=list)
    """Partial rollouts: response tokens already sampled (under earlier adapters); the engine continues
    from prompt + prefix with ``max_new_tokens - len(prefix_ids)`` tokens left, and the ``Result`` holds
    the whole response (prefix first)."""
    prefix_logprobs: list[float] = field(default_factory=list)
    """The behaviour log-probs of ``prefix_ids`` (as sampled), carried into the ``Result`` unchanged."""

    def check_prefix(self, max_new_tokens: int) -> None:
        """A ValueError naming the request unless its prefix leaves tokens of ``max_new_tokens`` to
        generate and carries one behaviour log-prob per token (every engine's precondition)."""
        if len(self.prefix_ids) >= max_new_tokens or len(self.prefix_logprobs) != len(self.prefix_ids):
            raise ValueError(f"request {self.key}: a prefix of {len(self.prefix_ids)} tokens "
                             f"({len(self.prefix_logprobs)} log-probs) must be shorter than max_new_tokens="
                             f"{max_new_tokens}, one log-prob per token")


@dataclass
class Result:
    key: tuple
    response_ids: list[int]
    logprobs: list[float]
    finish_reason: str = "length"
    """"stop" (a stop token was sampled; it is part of the response), "length", or "interrupted"
    (``RolloutEngine.interrupt`` at a weight push: the response so far, to be continued)."""
    mask: Optional[list] = None
    """Multi-turn episodes (``rl.tasks.episodes``): 1 for each token the policy sampled, 0 for observation
    tokens the environment appended (their ``logprobs`` are 0); None: every token is the policy's."""
    routes: Optional[object] = None
    """R3: the experts the engine chose, numpy uint8 [len(prompt) + len(response) - 1, moe_layers, top_k]
    (every token it processed; ``rl.train.routing``), or None when the engine does not report them."""
    index_topk: Optional[tuple] = None
    """DSA: (positions int32 [m], selected keys int32 [m, indexer_layers, index_topk]) of sampled query rows."""
    version: Optional[int] = None
    """Stream engines (``RolloutEngine.STREAMS``): the ``AdapterPayload.version`` (-1: none) its tokens past the
    request's prefix were sampled under; None from ``generate`` (the caller knows the job's adapter)."""
    tool_stats: Optional[dict] = None
    """Tool episodes: counts of calls, errors, timeouts, cut and dropped observations (``rl.tasks.episodes``)."""


@dataclass
class AdapterPayload:
    """An HF PEFT adapter as bytes (adapter_config.json + adapter_model.safetensors): what the
    trainer pushes to the engines after each update; ``None`` files = base model."""
    version: int
    files: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(len(v) for v in self.files.values())


def token_seed(seed: int, position: int) -> int:
    """The seed of response token ``position`` of a sample seeded ``seed`` (``SamplingParams.seed_per_token``)."""
    return (seed * 0x9E3779B97F4A7C15 + (position + 1) * 0xBF58476D1CE4E5B9) & ((1 << 63) - 1)


def sample_seed(seed: int, step: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed from (run seed, step, prompt, sample), stable across restarts and layouts."""
    import hashlib

    h = hashlib.blake2b(f"{seed}/{step}/{prompt_index}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


SLEEP_LEVELS = (1, 2)
"""vLLM's: 1 = weights to host memory, KV cache discarded; 2 = weights and KV cache discarded (the next
push must bring every weight back)."""
WAKE_TAGS = ("weights", "kv_cache")


class Occupancy:
    """Live rows x seconds accumulated by the decode loops; ``take()`` is their time average over the wall
    time since the last ``take`` (idle time counts as empty slots), divided by ``slots``."""

    def __init__(self, slots: int):
        self.slots, self.live_s, self.t0 = slots, 0.0, time.perf_counter()

    def add(self, live: int, seconds: float) -> None:
        self.live_s += live * seconds

    def take(self) -> dict:
        now = time.perf_counter()
        wall, self.t0 = max(now - self.t0, 1e-9), now
        live_s, self.live_s = self.live_s, 0.0
        return {"occupancy": live_s / (self.slots * wall), "live_row_s": live_s, "wall_s": wall, "slots": self.slots}


class RolloutEngine(ABC):
    """One engine per rollout actor. ``hf_dir`` is the base HF checkpoint; the adapter arrives
    through ``load_adapter``.

    Colocated with the trainer (``rl.schedule.colocate``) the engine also ``sleep``s between generation phases
    and ``wake_up``s before them (vLLM's ``LLM.sleep(level)`` / ``LLM.wake_up(tags)``). The defaults
    here are logged no-ops returning what they did, for an engine that holds nothing worth freeing."""

    FORWARDS_KWARGS = False
    """True: ``engine_kwargs`` the engine does not name go on to its backend, whose own check refuses
    unknown ones (``vllm.LLM``'s ``EngineArgs``); False: such a key is refused by ``check_kwargs``."""
    SPANS_BUNDLES = False
    """Its ``tensor_parallel_size × pipeline_parallel_size`` workers run in Ray placement-group bundles it is told
    of (vLLM's Ray executor: ``rl.cluster.engine_placement``), so a colocated engine spans the trainer's GPUs."""

    def __init__(self, hf_dir: str, deterministic_topk: bool = True, **kwargs):
        self.hf_dir = hf_dir
        self.deterministic_topk = deterministic_topk

    @classmethod
    def check_kwargs(cls, kwargs: dict) -> None:
        """``rollout.engine_kwargs`` checked before Ray starts: a key no ``__init__`` of the engine's classes
        names is a ValueError listing the known ones (unless ``FORWARDS_KWARGS``)."""
        import inspect

        known = set()
        for klass in cls.__mro__:
            init = klass.__dict__.get("__init__")
            if init is not None:
                known |= {n for n, p in inspect.signature(init).parameters.items()
                          if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        known -= {"self", "hf_dir", "deterministic_topk"}
        unknown = sorted(set(kwargs) - known)
        if unknown and not cls.FORWARDS_KWARGS:
            raise ValueError(f"rollout.engine_kwargs: unknown key(s) {unknown} for {cls.__module__}.{cls.__name__}; "
                             f"known: {sorted(known)}")

    @abstractmethod
    def generate(self, requests: list[Request], params: SamplingParams, batched: bool = True) -> list[Result]:
        ...

    @abstractmethod
    def load_adapter(self, payload: Optional[AdapterPayload]) -> None:
        ...

    STREAMS = False
    """True: the engine also decodes continuously (``stream_submit(requests, params)``, ``stream_poll(timeout_s)
    -> finished results``, ``take_occupancy()``; ``rl.rollout.hf_slots``), which fully async RL then uses."""

    STATIC_GENERATE = False
    """True: ``generate`` decodes a static batch, every row until the batch's longest response ends (the HF
    engine's), so where the engine also ``STREAMS`` the synchronous and one-step-off modes decode on the stream
    (``rl.cluster.rollout_pool.engine_streams``): the continuous batching every mode of a vLLM user has. False
    (vLLM: ``LLM.generate`` batches continuously already): those modes keep ``generate``."""

    INTERRUPTIBLE = False
    """True: ``interrupt`` ends a running ``generate`` at the next token boundary (partial rollouts)."""

    def interrupt(self) -> bool:
        """Called from another thread (a weight push): the running ``generate`` returns at the next token
        boundary, unfinished responses with ``finish_reason="interrupted"``; no-op when idle. Returns
        whether this engine can interrupt (the default cannot: its requests run to the end)."""
        return False

    def last_push(self) -> dict:
        """How the last ``load_adapter`` reached the engine ({} when there is nothing to say)."""
        return {}

    pushes: Optional[list] = None
    """An engine that reports its pushes: one ``last_push()``-shaped dict per ``load_adapter`` since they were
    last taken (``rl.cluster.rollout_actor.RolloutActor.take_pushes``; ``push_metrics``)."""

    def sleep(self, level: int) -> str:
        """Free this engine's accelerator memory until ``wake_up``; returns a one-line account."""
        check_sleep_level(level)
        msg = f"{type(self).__name__}.sleep(level={level}): no-op (nothing to free)"
        log.info(msg)
        return msg

    def wake_up(self, tags: tuple = WAKE_TAGS) -> str:
        """Bring back what ``sleep`` freed, ``tags`` of ``WAKE_TAGS`` (weights first, then the KV cache)."""
        check_wake_tags(tags)
        msg = f"{type(self).__name__}.wake_up(tags={list(tags)}): no-op (nothing was freed)"
        log.info(msg)
        return msg


def check_sleep_level(level: int) -> None:
    if level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level {level!r}: one of {SLEEP_LEVELS}")


def check_wake_tags(tags) -> None:
    bad = [t for t in tags if t not in WAKE_TAGS]
    if bad or not tags:
        raise ValueError(f"wake_up tags {list(tags)!r}: a non-empty subset of {WAKE_TAGS}")


def push_metrics(pushes: list[dict]) -> dict:
    """``rollout/push_*`` of the adapter pushes the engines reported since the last step (``RolloutEngine.pushes``):
    bytes per push that travelled as a LoRA adapter and as merged weights, seconds per push, how many waited for
    live requests, and per family the smallest fraction of the adapter's delta a merged push kept
    (``rollout/merged_delta_kept/<family>``). {} without pushes."""
    if not pushes:
        return {}
    out = {"rollout/push_lora_bytes": max(p.get("lora_bytes", 0) for p in pushes),
           "rollout/push_merged_bytes": max(p.get("merged_bytes", 0) for p in pushes),
           "rollout/push_s": max(p.get("seconds", 0.0) for p in pushes),
           "rollout/push_waited": sum(bool(p.get("waited")) for p in pushes)}
    for p in pushes:
        for fam, frac in (p.get("merged_delta_kept") or {}).items():
            key = f"rollout/merged_delta_kept/{fam}"
            out[key] = min(out.get(key, 1.0), float(frac))
    return out


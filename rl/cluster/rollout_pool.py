"""The rollout engines on Ray: ``RolloutPool`` starts ``rollout.num_actors`` engine actors
(``rl.cluster.rollout_actor.RolloutActor``, each holding the ``rollout.engine`` class). A step's prompts are split over them by prompt (a prompt's ``n``
samples stay on one actor); an actor that dies mid-step is replaced (base weights + the current adapter) and
its prompts are redone, with the same per-sample seeds, so no sample is lost or counted twice.
"""

from __future__ import annotations

from typing import Optional

import ray

from glm5_mcore.checkpoint.layout import serving_dir
from rl.cluster.engine_placement import actor_setup
from rl.cluster.ray_jobs import RayJobError, cause_line, error_line, wait_for
from rl.cluster.rollout_actor import RolloutActor, load_class
from rl.rollout.base import AdapterPayload, Request, Result, SamplingParams


def engine_streams(cfg) -> bool:
    """Whether the run decodes on the engines' stream (``stream_submit`` / ``stream_poll``, continuous batching)
    rather than ``generate`` jobs: the engine streams (``RolloutEngine.STREAMS``: the HF and vLLM engines),
    ``rollout.engine_kwargs.stream`` is not false, no tool episodes (a turn loop per sample stays on
    ``generate``), and either the run is fully async (``trainer.max_staleness``) or the engine's ``generate`` is
    a static batch (``STATIC_GENERATE``: the HF engine's; vLLM's ``generate`` batches continuously already). So
    every mode of the HF engine streams by default (docs/rl-async.md: the figures), and ``stream=false`` keeps
    the static-batch ``generate``."""
    engine = load_class(cfg.rollout.engine)
    if not (engine.STREAMS and cfg.rollout.engine_kwargs.get("stream", True) and not cfg.rollout.multi_turn.enable):
        return False
    return bool(cfg.trainer.max_staleness or getattr(engine, "STATIC_GENERATE", False))


class RolloutPool:
    CPU_NICE = 4
    """With one-step-off-policy or async overlap and no GPUs (engines and trainer ranks share the CPU cores),
    the engine processes run this much lower in CPU priority than the trainer (CFS weights 1024 : 423): the
    trainer is the chain every step waits for, and the scheduler stays work-conserving, so generation still
    takes every cycle the trainer leaves. On top of the workers' niceness: 0 in a Ray this job starts
    (``rl.cluster.ray_jobs.WORKER_NICENESS``), so the engines end at 4 and still get their share beside the
    node's other processes (on top of Ray's default 15 they ended at 19, weight 15 against 1024: starved)."""

    def __init__(self, cfg, placement_group=None):
        """``placement_group``: the trainer's (``TrainerGroup.pg``) for colocated engines: engine ``i`` covers
        bundles ``[i·span, (i+1)·span)`` of it, ``span = world_size / num_actors``, with
        ``rollout.colocate.engine_fraction`` of each (``rl.cluster.engine_placement``)."""
        self.cfg = cfg
        self.pg = placement_group
        self.payload: Optional[AdapterPayload] = None
        self.restarts = 0
        self.events: list[str] = []
        self.loading: list = []
        self.streams = engine_streams(cfg)
        self.stream_live: dict[tuple, tuple] = {}  # request key -> (actor, Request, params): submitted, not back
        self.polls: dict = {}  # actor -> its stream_poll in flight
        self.submits: list = []
        self.actors = [self._new(i) for i in range(cfg.rollout.num_actors)]
        try:
            self._started(range(len(self.actors)))
        except ray.exceptions.RayActorError as e:  # the process died (OOM, a crash) while starting
            self.shutdown()
            raise RayJobError(f"a rollout actor died while starting rollout.engine={cfg.rollout.engine}: "
                              f"{cause_line(e)}") from None
        except BaseException:
            self.shutdown()
            raise

    def _started(self, which) -> None:
        """Wait (``wait_for``: says what it waits for, times out) until the actors ``which`` have started
        their engines. An engine that fails in start-up is a setting, not a crash a restart cures: one
        line naming the engine, ``rollout.engine_kwargs`` and the cause."""
        refs = {i: self.actors[i].ready.remote() for i in which}
        wait_for(list(refs.values()), f"{len(refs)} rollout actor(s) to start {self.cfg.rollout.engine}", self.cfg)
        for i, ref in refs.items():
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                if not e.actor_init_failed:
                    raise
                r = self.cfg.rollout
                raise RayJobError(f"rollout actor {i}: rollout.engine={r.engine} failed to start with "
                                  f"rollout.engine_kwargs={dict(r.engine_kwargs)}: {cause_line(e)}") from None

    def _new(self, i: int):
        r, t = self.cfg.rollout, self.cfg.trainer
        kwargs = dict(r.engine_kwargs)
        if self.pg is not None:  # colocated: in the trainer's bundles, one GPU or several (rl.cluster.engine_placement)
            opts, kwargs, _ = actor_setup(self.cfg, i, self.pg)
        else:
            opts = dict(num_cpus=1, num_gpus=r.gpus_per_actor)
        job_kwargs = getattr(load_class(r.engine), "job_kwargs", None)  # e.g. vLLM's LoRA targets and versions
        if job_kwargs is not None:
            kwargs = job_kwargs(kwargs, self.cfg.lora.targets, t.max_staleness)
        shared = (t.off_policy_steps > 0 or t.max_staleness > 0) and not r.gpus_per_actor and not t.gpus_per_rank
        return RolloutActor.options(max_concurrency=1, **opts).remote(
            r.engine, serving_dir(self.cfg.model.hf_dir, self.cfg.model.ckpt, self.cfg.rollout.hf_dir),
            r.deterministic_topk, kwargs, r.multi_turn,
            self.CPU_NICE if shared else 0, r.routes_inline_bytes)

    def sleep(self, level: int) -> list[str]:
        """Every engine's ``sleep(level)``; what each reported (an actor that died is replaced)."""
        return [msg for _, msg in self._each(lambda a: a.sleep.remote(level))]

    def wake_up(self, tags: tuple) -> list[str]:
        return [msg for _, msg in self._each(lambda a: a.wake_up.remote(tuple(tags)))]

    def nodes(self) -> list[str]:
        return [n for _, n in self._each(lambda a: a.node_id.remote())]

    def sync(self, payload: Optional[AdapterPayload], wait: bool = True) -> list:
        """Push the adapter to every actor (kept for actors started later). ``wait=False`` queues the load
        behind each actor's in-flight generation (actor calls run in order) and returns at once: the
        one-step-off-policy path, where the engines are still generating with the previous adapter.
        Returns what each engine reported of the push (``RolloutEngine.last_push``; [] without waiting)."""
        self.payload = payload
        data = ray.put(payload) if len(self.actors) > 1 else payload  # one copy in the object store
        if wait:
            return [got for _, got in self._each(lambda a: a.load_adapter.remote(data))]
        self.loading = [a.load_adapter.remote(data) for a in self.actors]
        return []

    def interrupt(self) -> None:
        """Every engine's running generation stops at its next token boundary (partial rollouts: the
        caller continues the interrupted responses); an actor that died is left to ``collect``."""
        refs = [a.interrupt.remote() for a in self.actors]
        for ref in refs:
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError):
                pass

    def _each(self, fn):
        out = []
        for i in range(len(self.actors)):
            for attempt in range(self.cfg.rollout.max_restarts + 1):
                try:
                    out.append((i, ray.get(fn(self.actors[i]))))
                    break
                except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as e:
                    self._replace(i, e)
                except ray.exceptions.RayTaskError as e:
                    raise RayJobError(f"rollout actor {i}, {error_line(e)}") from None
            else:
                raise RayJobError(f"rollout actor {i} keeps dying ({self.cfg.rollout.max_restarts} restarts)")
        return out

    def _replace(self, i: int, err, payload=False, note: str = "") -> None:
        self.restarts += 1
        if self.restarts > self.cfg.rollout.max_restarts * len(self.actors) + 100:
            raise RuntimeError(f"rollout actors died {self.restarts} times; last: {err}")
        for attempt in range(self.cfg.rollout.max_restarts + 1):
            try:
                ray.kill(self.actors[i])
            except Exception:
                pass
            self.actors[i] = self._new(i)
            try:  # a replacement that fails in start-up is refused by _started; one that dies here is retried
                self._started([i])
                ray.get(self.actors[i].load_adapter.remote(self.payload if payload is False else payload))
                break
            except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as e:
                err = e
        else:
            raise RayJobError(f"rollout actor {i}: its replacement died {self.cfg.rollout.max_restarts + 1} times "
                              f"while starting (rollout.max_restarts={self.cfg.rollout.max_restarts}); last: "
                              f"{cause_line(err)}")
        self.events.append(f"rollout actor {i} died ({type(err).__name__}); restarted{note}")

    def generate(self, requests: list[Request], params: SamplingParams) -> list[Result]:
        """Every request exactly once, in order; shards by prompt over the actors, redoing the shard
        of an actor that dies."""
        return self.collect(self.submit(requests, params))

    def submit(self, requests: list[Request], params: SamplingParams) -> dict:
        """Start generating ``requests`` (sharded by prompt) and return at once; ``collect`` waits. The
        adapter is the last one ``sync``-ed before this call (its version travels with the handle)."""
        self.settle_loads()
        prompt_ids = sorted({r.key[0] for r in requests})
        n = len(self.actors)
        owner = {p: j % n for j, p in enumerate(prompt_ids)}
        shards = [[r for r in requests if owner[r.key[0]] == i] for i in range(n)]
        pending = {i: self.actors[i].generate.remote(shards[i], params, self.cfg.rollout.batch_prompts)
                   for i in range(n) if shards[i]}
        return {"requests": requests, "params": params, "shards": shards, "pending": pending,
                "payload": self.payload, "version": self.payload.version if self.payload is not None else -1}

    def settle_loads(self) -> None:
        """Wait for queued ``sync(wait=False)`` loads (done by now: they ran after the previous generation),
        so a failed load stops the run instead of leaving an actor on an old adapter; a dead actor is
        replaced, with the current adapter, by the next ``collect`` or ``stream_poll``."""
        loads, self.loading = self.loading, []
        for ref in loads:
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError):
                pass

    def collect(self, job: dict) -> list[Result]:
        """The results of a ``submit``, in request order. An actor that died is replaced, loaded with the
        adapter the job started with, redoes its shard, then gets the current adapter back."""
        pending, shards, params = job["pending"], job["shards"], job["params"]
        tries = {i: 0 for i in pending}
        results: dict[tuple, Result] = {}
        while pending:
            ready, _ = ray.wait(list(pending.values()), num_returns=1)
            i = next(k for k, v in pending.items() if v == ready[0])
            del pending[i]
            try:
                got = ray.get(ready[0])
            except ray.exceptions.RayTaskError as e:
                raise RayJobError(f"rollout actor {i}, {error_line(e)}") from None
            except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as e:
                tries[i] += 1
                if tries[i] > self.cfg.rollout.max_restarts:
                    raise RayJobError(f"rollout actor {i} died {tries[i]} times in one step (rollout.max_restarts="
                                      f"{self.cfg.rollout.max_restarts}); last: {cause_line(e)}") from None
                self._replace(i, e, job["payload"], f"; redoing its {len({r.key[0] for r in shards[i]})} prompts")
                pending[i] = self.actors[i].generate.remote(shards[i], params, self.cfg.rollout.batch_prompts)
                if job["payload"] is not self.payload:
                    self.actors[i].load_adapter.remote(self.payload)  # queued after the redo
                continue
            for res in got:
                if res.key in results:
                    raise RuntimeError(f"sample {res.key} returned twice")
                results[res.key] = res
        missing = [r.key for r in job["requests"] if r.key not in results]
        if missing:
            raise RuntimeError(f"samples {missing[:3]} never returned")
        return [results[r.key] for r in job["requests"]]

    # ------------------------------------------------------------------ continuous generation (the stream)
    def stream_submit(self, requests: list[Request], params: SamplingParams) -> None:
        """Queue ``requests`` on the engines and return at once: a prompt's samples go to one actor, each new
        prompt to the actor with the fewest requests in flight; ``stream_poll`` collects."""
        load = {i: 0 for i in range(len(self.actors))}
        owner: dict = {}
        for i, _, _ in self.stream_live.values():
            load[i] += 1
        for key, (i, _, _) in self.stream_live.items():
            owner.setdefault(key[0:1] + key[2:], i)
        shards: dict[int, list] = {}
        for r in requests:
            if r.key in self.stream_live:
                raise RuntimeError(f"sample {r.key} submitted while still in flight")
            p = r.key[0:1] + r.key[2:]  # (prompt, generation batch): the samples of one group
            if p not in owner:
                owner[p] = min(load, key=load.get)
            i = owner[p]
            load[i] += 1
            self.stream_live[r.key] = (i, r, params)
            shards.setdefault(i, []).append(r)
        self.submits += [(i, self.actors[i].stream_submit.remote(reqs, params)) for i, reqs in shards.items()]

    def stream_poll(self, timeout_s: float = 0.5) -> list[Result]:
        """The results finished since the last poll (at least one, unless ``timeout_s`` passes or nothing is in
        flight), each with ``Result.version``. An actor that died is replaced with the current adapter and its
        requests in flight are submitted again, from the prefixes they were submitted with. Before returning, the
        next poll of every engine with requests in flight is sent: it decodes while the caller books and scores
        these, instead of waiting for the caller's next call."""
        self._check_submits()
        self._poll_busy(timeout_s)
        if not self.polls:
            return []
        ready, _ = ray.wait(list(self.polls.values()), num_returns=1, timeout=timeout_s)
        if ready:
            ready, _ = ray.wait(list(self.polls.values()), num_returns=len(self.polls), timeout=0)
        out: list[Result] = []
        for i in [i for i, ref in self.polls.items() if ref in ready]:
            ref = self.polls.pop(i)
            try:
                got = ray.get(ref)
            except ray.exceptions.RayTaskError as e:
                raise RayJobError(f"rollout actor {i}, {error_line(e)}") from None
            except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError) as e:
                self._replace(i, e, note="; resubmitting its requests in flight")
                lost = [(r, p) for j, r, p in self.stream_live.values() if j == i]
                for r, p in lost:
                    del self.stream_live[r.key]
                    self.stream_submit([r], p)
                continue
            for res in got:
                if self.stream_live.pop(res.key, None) is None:
                    raise RuntimeError(f"sample {res.key} returned twice or never submitted")
                out.append(res)
        self._poll_busy(timeout_s)
        return out

    def _poll_busy(self, timeout_s: float) -> None:
        """A ``stream_poll`` in flight on every engine that holds requests and has none."""
        busy = {i for i, _, _ in self.stream_live.values()}
        for i in busy - set(self.polls):
            self.polls[i] = self.actors[i].stream_poll.remote(min(timeout_s, 0.25))

    def _check_submits(self) -> None:
        """A submit the engine refused (a bad request) stops the run with its line."""
        done = [(i, ref) for i, ref in self.submits if not ray.wait([ref], timeout=0)[1]]
        self.submits = [s for s in self.submits if s not in done]
        for i, ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayTaskError as e:
                raise RayJobError(f"rollout actor {i}, {error_line(e)}") from None
            except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError):
                pass  # its poll reports the death

    def occupancy(self) -> Optional[float]:
        """The engines' live rows / slots, time-averaged since the last call, averaged over the actors (None
        when no engine measures it)."""
        refs = [a.take_occupancy.remote() for a in self.actors]
        got = []
        for ref in refs:
            try:
                got.append(ray.get(ref))
            except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError):
                pass
        got = [g["occupancy"] for g in got if g is not None]
        return sum(got) / len(got) if got else None

    def pushes(self) -> list[dict]:
        """Every engine's adapter pushes since the last call (``RolloutActor.take_pushes``)."""
        out = []
        for ref in [a.take_pushes.remote() for a in self.actors]:
            try:
                out += ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError):
                pass
        return out

    def shutdown(self) -> None:
        for a in self.actors:
            ray.kill(a)

"""Ray start-up and waits shared by the trainer group and the rollout pool (``rl.cluster.trainer_group``, ``rl.cluster.rollout_pool``).

- ``start_ray``: a local Ray (or join ``ray.address``) whose workers get the run's quiet environment and the
  driver's CPU priority (``WORKER_NICENESS``).
- ``resources_needed`` / ``check_resources``: the CPUs / GPUs a job reserves, checked against a local cluster.
- ``wait_for``: wait on Ray refs, saying what for every minute, failing after ``ray.wait_timeout_s``.
- ``RayJobError``, ``cause_line``, ``error_line``: an actor's failure or a timed-out wait as one line.
"""

from __future__ import annotations

import gc
import os
import re
import sys
import time
from typing import Optional

import ray

_ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "WANDB_SILENT": "true",
        "PYTHONWARNINGS": "ignore", "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "RAY_DEDUP_LOGS": "1"}


WORKER_NICENESS = 0
"""The niceness of the workers of a Ray this job starts (Ray's ``worker_niceness``, default 15, as Ray's job
manager sets it for job drivers): the trainer and the engines compete with the node's other processes as the
driver does; in the overlapping modes the engines then run ``RolloutPool.CPU_NICE`` lower than the trainer.
A cluster joined by ``ray.address`` keeps its own setting. Nor does such a Ray prestart idle workers for the
first driver (``prestart_worker_first_driver``): the job's actors each start a worker of their own (their
placement-group bundles and resources), so prestarted ones sat idle, ~1.5 s of CPU and ~200 MB each."""


def start_ray(address: Optional[str], num_cpus: Optional[int], min_cpus: int = 0) -> None:
    """Local Ray by default (``num_cpus``, else at least ``min_cpus``: the actors the job reserves); join
    ``address`` ("auto", "ray://host:10001") when given. A second job in one process (a notebook, a
    sweep, the tests) starts after a ``gc.collect()`` of the first one's leftovers."""
    if ray.is_initialized():
        return
    # actor handles left in reference cycles by an earlier job of this process are finalized now, not
    # inside the new job: Ray derives actor ids from (job id, counter), so a late finalizer would drop
    # the new job's actor of the same id ("all references to the actor were removed", never ran)
    gc.collect()
    path = [p for p in (os.environ.get("PYTHONPATH", ""), os.getcwd()) if p]
    runtime_env = {"env_vars": {**_ENV, "PYTHONPATH": os.pathsep.join(path)}}
    if address:
        ray.init(address=address, runtime_env=runtime_env, log_to_driver=True)
    else:  # workers at the driver's priority (Ray's default niceness 15 starves them beside any other process)
        ray.init(num_cpus=num_cpus or max(4, os.cpu_count() or 1, min_cpus), include_dashboard=False,
                 runtime_env=runtime_env, log_to_driver=True, configure_logging=False,
                 _system_config={"worker_niceness": WORKER_NICENESS, "prestart_worker_first_driver": False})


class RayJobError(ValueError):
    """An actor's failure (naming the actor, the method and the cause) or a wait that timed out (naming
    what it waited for), as one line: a ValueError, so the entry point prints it and exits 2 instead of a
    ``ray::Actor.method()`` stack."""


def cause_line(e: BaseException) -> str:
    """``Type: message`` on one line: a ``RayTaskError``'s cause, the cause of an actor that died in its
    ``__init__`` (the last exception line of Ray's text), an actor whose process died with Ray's reason
    (exit type and detail: a crash, the memory monitor, a lost node), else the exception's first line."""
    if isinstance(e, ray.exceptions.RayTaskError) and isinstance(getattr(e, "cause", None), BaseException):
        return f"{type(e.cause).__name__}: {' '.join(str(e.cause).split())}"
    lines = str(e).splitlines()
    if lines and lines[0] == ray.exceptions.ActorDiedError.BASE_ERROR_MSG:  # a system death: Ray's reason follows
        why = [ln.strip() for ln in lines[1:] if ln.strip() and not ln.startswith("\t")]
        return " ".join(" ".join([lines[0], *why]).split())
    last = max((j for j, ln in enumerate(lines) if re.match(r"[A-Za-z_][\w.]*(Error|Exception|Exit)\b", ln)),
               default=None)
    return " ".join(" ".join(lines[last:]).split()) if last is not None else (lines[0] if lines else type(e).__name__)


def error_line(e: BaseException) -> str:
    """``Actor.method: Type: message`` (the actor and method from Ray's ``ray::Actor.method()`` text)."""
    where = re.search(r"ray::([\w.]+)\(", str(e))
    return f"{where.group(1)}: {cause_line(e)}" if where else cause_line(e)


def resources_needed(cfg) -> dict:
    """{"CPU": n, "GPU": n} the trainer ranks and rollout actors reserve."""
    t, r = cfg.trainer, cfg.rollout
    return {"CPU": float(t.world_size + r.num_actors),
            "GPU": float(t.world_size * t.gpus_per_rank + r.num_actors * r.gpus_per_actor)}


def _resource_text(cfg) -> str:
    t, r = cfg.trainer, cfg.rollout
    need = resources_needed(cfg)
    have = ray.cluster_resources()
    return (f"trainer.world_size={t.world_size} ranks (1 CPU, trainer.gpus_per_rank={t.gpus_per_rank} GPU each) + "
            f"rollout.num_actors={r.num_actors} engines (1 CPU, rollout.gpus_per_actor={r.gpus_per_actor} GPU each) "
            f"need {need['CPU']:g} CPUs, {need['GPU']:g} GPUs; the Ray cluster has {have.get('CPU', 0):g} CPUs, "
            f"{have.get('GPU', 0):g} GPUs")


def check_resources(cfg) -> None:
    """A local Ray cluster (started here: it cannot grow) without the CPUs / GPUs the job reserves is one
    line naming the settings, instead of actors waiting forever to be scheduled."""
    need, have = resources_needed(cfg), ray.cluster_resources()
    if any(v > have.get(k, 0.0) + 1e-9 for k, v in need.items()):
        raise ValueError(f"{_resource_text(cfg)} (ray.num_cpus, or ray.address of a bigger cluster)")


def wait_for(refs: list, what: str, cfg, timeout: Optional[float] = None, every: float = 60.0) -> None:
    """Wait until every ref in ``refs`` is ready, saying what it waits for each ``every`` seconds (on
    stderr) and failing after ``ray.wait_timeout_s`` (or ``timeout``) with the resources asked and had."""
    timeout = cfg.ray.wait_timeout_s if timeout is None else timeout
    t0, pending = time.monotonic(), list(refs)
    while pending:
        left = timeout - (time.monotonic() - t0)
        if left <= 0:
            raise RayJobError(f"{what}: not ready after ray.wait_timeout_s={timeout:g} s; {_resource_text(cfg)}")
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=min(every, left))
        if pending and time.monotonic() - t0 < timeout:
            print(f"glm5 rl: waiting for {what} ({len(pending)} of {len(refs)} not ready after "
                  f"{time.monotonic() - t0:.0f} s; {_resource_text(cfg)})", file=sys.stderr, flush=True)


def node_id() -> str:
    return ray.get_runtime_context().get_node_id()

"""Where each rollout engine runs on Ray, and an engine that spans several of the trainer's GPUs.

A colocated engine (``rollout.colocate.enable``) time-shares the trainer's placement-group bundles: engine ``i`` of
``rollout.num_actors`` covers bundles ``[i·span, (i+1)·span)``, ``span = trainer.world_size / num_actors``.

- **One GPU** (``tensor_parallel_size × pipeline_parallel_size = 1``): the engine's actor itself takes
  ``rollout.colocate.engine_fraction`` of its first bundle (CPU and GPU) and vLLM runs in it (its ``uni`` executor).
- **Several GPUs, across nodes**: vLLM's own Ray executor over the trainer's bundles, verl's and NeMo-RL's way. The
  actor holds no GPU; it is scheduled into its first bundle with ``placement_group_capture_child_tasks``, so
  ``ray.util.get_current_placement_group()`` inside it is the trainer's group, which vLLM's executor uses
  (``v1/executor/ray_utils.py:578-582``); ``VLLM_RAY_BUNDLE_INDICES`` names the engine's bundles (one worker each,
  ``ray_executor.py:184-199``) and ``VLLM_RAY_PER_WORKER_GPUS`` the fraction of each GPU a worker takes (the
  engine's share). ``distributed_executor_backend="ray"`` (vLLM would pick ``mp`` and refuse a world larger
  than the node: ``config/parallel.py:1035-1058``). TP stays within a node, PP spans nodes (offline ``LLM``
  refuses ``data_parallel_size > 1``: ``entrypoints/llm.py:282-294``; ``rl.validate`` says so before Ray). Its
  merged pushes go by file (CUDA IPC reaches one GPU only) under ``{trainer.out}/push``, which the engine's
  workers on every node must see (the run folder on a shared file system, as its checkpoints need).

``actor_setup`` gives the actor's Ray options, the engine kwargs and the environment; ``RolloutPool`` uses it.
"""

from __future__ import annotations

import importlib
from pathlib import Path

VLLM = "VLLMRolloutEngine"


def engine_class(path: str):
    """``rollout.engine``'s class (``rl.validate`` has checked that it imports)."""
    mod, _, name = path.rpartition(".")
    return getattr(importlib.import_module(mod), name)


def engine_gpus(engine_kwargs: dict) -> int:
    """GPUs one vLLM engine spans: ``tensor_parallel_size × pipeline_parallel_size``."""
    return int(engine_kwargs.get("tensor_parallel_size", 1)) * int(engine_kwargs.get("pipeline_parallel_size", 1))


def bundles(cfg, i: int) -> list[int]:
    """The trainer's placement-group bundles colocated engine ``i`` covers."""
    span = cfg.trainer.world_size // cfg.rollout.num_actors
    return list(range(i * span, (i + 1) * span))


def spans_gpus(cfg) -> bool:
    """Colocated engines of more than one GPU each whose workers Ray places in the trainer's bundles (the engine
    class's ``SPANS_BUNDLES``: vLLM's Ray executor)."""
    r = cfg.rollout
    return (r.colocate.enable and engine_gpus(r.engine_kwargs) > 1
            and getattr(engine_class(r.engine), "SPANS_BUNDLES", False))


def actor_setup(cfg, i: int, placement_group) -> tuple[dict, dict, dict]:
    """(Ray options of engine ``i``'s actor, its engine kwargs, its environment variables) for a colocated
    engine in ``placement_group`` (the trainer's)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    r, t = cfg.rollout, cfg.trainer
    f = r.colocate.engine_fraction
    kwargs, env = dict(r.engine_kwargs), {}
    mine = bundles(cfg, i)
    if r.engine.endswith(VLLM):
        kwargs.setdefault("sleep_mode", True)
    if not spans_gpus(cfg):
        if r.engine.endswith(VLLM):
            kwargs.setdefault("weight_transport", "handles")  # same GPU: CUDA IPC, no file (rl.rollout.weight_sync)
        opts = dict(num_cpus=f, num_gpus=t.gpus_per_rank * f, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group, placement_group_bundle_index=mine[0]))
        return opts, kwargs, env
    kwargs.setdefault("distributed_executor_backend", "ray")
    kwargs.setdefault("weight_transport", "file")
    kwargs.setdefault("push_dir", str(Path(t.out) / "push" / f"engine{i}"))
    env["VLLM_RAY_BUNDLE_INDICES"] = ",".join(map(str, mine))
    env["VLLM_RAY_PER_WORKER_GPUS"] = repr(t.gpus_per_rank * f)
    opts = dict(num_cpus=f, num_gpus=0, runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group, placement_group_bundle_index=mine[0],
                    placement_group_capture_child_tasks=True))
    return opts, kwargs, env


def check(cfg) -> None:
    """The engine layouts vLLM 0.32 and this placement accept, refused in one line (``rl.validate``)."""
    r, t = cfg.rollout, cfg.trainer
    if not r.engine.endswith(VLLM):
        return
    kw = r.engine_kwargs
    dp = int(kw.get("data_parallel_size", 1))
    if dp > 1:
        raise ValueError(f"rollout.engine_kwargs.data_parallel_size={dp}: vLLM's offline LLM refuses data "
                         "parallelism in one process (entrypoints/llm.py:282-294); use more engines "
                         "(rollout.num_actors) or pipeline_parallel_size across nodes")
    g = engine_gpus(kw)
    if not spans_gpus(cfg):
        return
    span = t.world_size // r.num_actors
    if g != span:
        raise ValueError(f"rollout.engine_kwargs: tensor_parallel_size x pipeline_parallel_size = {g} GPUs, but "
                         f"each of the rollout.num_actors={r.num_actors} colocated engines covers trainer.world_size"
                         f" / num_actors = {span} bundles; make them equal")
    if kw.get("weight_transport", "file") == "handles":
        raise ValueError(f"rollout.engine_kwargs.weight_transport=handles: a CUDA IPC handle reaches one GPU, the "
                         f"engine spans {g}; use file (merged pushes under trainer.out/push)")
    if not t.gpus_per_rank:
        raise ValueError(f"rollout.engine_kwargs: an engine over {g} of the trainer's bundles runs vLLM's Ray "
                         "executor on their GPUs; trainer.gpus_per_rank=0 gives them none")

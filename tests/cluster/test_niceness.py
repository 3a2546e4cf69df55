"""CPU priority on a shared node (issue 41 item 4): the workers of a Ray the job starts run at the driver's
niceness (``rl.cluster.ray_jobs.WORKER_NICENESS``, not Ray's default 15), and an overlapping mode's engines
run ``RolloutPool.CPU_NICE`` below it: 4, where on top of Ray's 15 they ended at 19 and starved beside any
other process."""

import os

import pytest

from rl.rollout.base import RolloutEngine
from tests.support.rl_setup import local_ray

pytestmark = [pytest.mark.slow, pytest.mark.ray]  # starts a local Ray


class NiceProbeEngine(RolloutEngine):
    """No model: ``last_push()`` says the niceness of the process the engine runs in."""

    def generate(self, requests, params, batched=True):
        return []

    def load_adapter(self, payload):
        pass

    def last_push(self) -> dict:
        return {"nice": os.nice(0)}


def test_workers_run_at_the_drivers_priority_and_overlapping_engines_just_below():
    import ray

    from rl.cluster.ray_jobs import WORKER_NICENESS
    from rl.cluster.rollout_pool import RolloutActor, RolloutPool

    base = os.nice(0)  # Ray's niceness is added to the raylet's, which has the driver's (0 unless run under nice)
    with local_ray(num_cpus=2):
        worker = ray.remote(num_cpus=0)(lambda: os.nice(0))
        assert ray.get(worker.remote()) == base + WORKER_NICENESS and WORKER_NICENESS == 0
        engines = [RolloutActor.options(num_cpus=0).remote("tests.cluster.test_niceness.NiceProbeEngine", "unused",
                                                           True, {}, None, nice) for nice in (0, RolloutPool.CPU_NICE)]
        got = [ray.get(a.load_adapter.remote(None))["nice"] for a in engines]
        assert got == [base, min(19, base + RolloutPool.CPU_NICE)] and RolloutPool.CPU_NICE == 4

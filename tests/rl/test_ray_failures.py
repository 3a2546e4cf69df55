"""Issue 34 (classes 4, 6, 13) with a real local Ray: every wait on actors has a timeout and says what it
waits for, and each failure is one line naming the actor, method or setting — a job needing more CPUs
than the cluster has, an engine that fails in start-up (not restarted forever), a replacement engine
that dies while starting, an engine that raises, a trainer rank that dies while the others block."""

import os
import time

import pytest

from tests.support.rl_setup import local_ray, ray_run_dict

pytestmark = [pytest.mark.slow, pytest.mark.ray]


@pytest.fixture(scope="module")
def ray3():
    """A local Ray of 3 CPUs whose workers import tests.support.rl_fault_engine."""
    with local_ray(3):
        yield


def _cfg(tiny_dir, out, **sections):
    from rl.config import RLConfig

    return RLConfig.from_dict(ray_run_dict(tiny_dir, out, {
        "data": {"prompts_per_step": 2}, "rollout": {"n": 2, "max_new_tokens": 2, "num_actors": 1},
        "actor": {"ppo_mini_batch_size": 2}, "trainer": {"steps": 1}}, **sections))


def test_more_cpus_than_the_local_cluster_is_refused_and_waits_time_out(tiny_dir, tmp_path, ray3):
    """Was: ``ray.get(pg.ready())`` waiting forever, no message."""
    from rl.driver import run
    from rl.cluster.ray_jobs import RayJobError
    from rl.cluster.trainer_group import TrainerGroup

    cfg = _cfg(tiny_dir, tmp_path / "rl", trainer={"world_size": 4}, rollout={"num_actors": 2})
    with pytest.raises(ValueError, match=r"trainer.world_size=4 ranks .* \+ rollout.num_actors=2 engines .* need 6 "
                                         r"CPUs, 0 GPUs; the Ray cluster has 3 CPUs, 0 GPUs \(ray.num_cpus"):
        run(cfg)
    cfg.ray.wait_timeout_s = 2.0  # a remote cluster (no up-front check): the wait itself gives up, saying why
    t0 = time.monotonic()
    with pytest.raises(RayJobError, match=r"the placement group of the 4 trainer ranks: not ready after "
                                          r"ray.wait_timeout_s=2 s; .* need 6 CPUs"):
        TrainerGroup(cfg)
    assert time.monotonic() - t0 < 30


def test_engine_failing_at_start_up_is_one_line_not_restarted(tiny_dir, tmp_path, ray3):
    """Was: the actor restarted, then dying the same way, then a 106-line wall from ``_replace``."""
    from rl.cluster.ray_jobs import RayJobError
    from rl.cluster.rollout_pool import RolloutPool

    cfg = _cfg(tiny_dir, tmp_path / "rl", rollout={"engine": "tests.support.rl_fault_engine.FailingEngine",
                                                   "engine_kwargs": {"reason": "bad weights"}})
    with pytest.raises(RayJobError) as e:
        pool = RolloutPool(cfg)
        pool.sync(None)
    msg = str(e.value)
    assert msg == ("rollout actor 0: rollout.engine=tests.support.rl_fault_engine.FailingEngine failed to start "
                   "with rollout.engine_kwargs={'reason': 'bad weights'}: ValueError: bad weights"), msg


def test_replacement_dying_while_starting_and_engine_errors_are_one_line(tiny_dir, tmp_path, ray3):
    """Was: an unguarded ``ray.get`` in ``RolloutPool._replace`` crashing the run despite ``max_restarts``;
    an engine's exception as a ``ray::RolloutActor.generate()`` stack."""
    from rl.rollout.base import Request, SamplingParams
    from rl.cluster.ray_jobs import RayJobError
    from rl.cluster.rollout_pool import RolloutPool

    reqs = [Request((0, k), [5, 6, 7], k) for k in range(2)]
    cfg = _cfg(tiny_dir, tmp_path / "rl", rollout={
        "engine": "tests.support.rl_fault_engine.DieOnRestartEngine", "max_restarts": 1,
        "engine_kwargs": {"die_marker": str(tmp_path / "died")}})
    pool = RolloutPool(cfg)
    pool.sync(None)
    with pytest.raises(RayJobError, match=r"rollout actor 0: its replacement died 2 times while starting "
                                          r"\(rollout.max_restarts=1\); last: "):
        pool.generate(reqs, SamplingParams(max_new_tokens=2, stop_token_ids=(1,)))
    pool.shutdown()
    pool = RolloutPool(_cfg(tiny_dir, tmp_path / "rl",
                            rollout={"engine": "tests.support.rl_fault_engine.RaisingEngine"}))
    pool.sync(None)
    with pytest.raises(RayJobError) as e:
        pool.generate(reqs, SamplingParams(max_new_tokens=2, stop_token_ids=(1,)))
    pool.shutdown()
    assert str(e.value) == "rollout actor 0, RolloutActor.generate: ValueError: engine says no: the request is bad"


def test_trainer_rank_death_ends_the_wait_and_says_the_command_resumes(tmp_path, ray3):
    """Was: ``ray.get`` of every rank in order: rank 0 blocked (in a collective) kept the driver waiting,
    then an ``ActorDiedError`` stack with no word on resuming."""
    import ray

    from rl.cluster.ray_jobs import RayJobError
    from rl.cluster.trainer_group import TrainerGroup

    @ray.remote(num_cpus=0)
    class Rank:
        def work(self, die: bool):
            if die:
                os._exit(1)
            time.sleep(120)  # a rank blocked on its dead peer

    (tmp_path / "iter_0000003").mkdir()
    (tmp_path / "latest").write_text("3")
    group = TrainerGroup.__new__(TrainerGroup)  # the gather alone (no placement group, no model)
    group.out = str(tmp_path)
    ranks = [Rank.remote(), Rank.remote()]
    t0 = time.monotonic()
    with pytest.raises(RayJobError) as e:
        group.gather([ranks[0].work.remote(False), ranks[1].work.remote(True)], "PolicyTrainer.update")
    assert time.monotonic() - t0 < 60
    msg = str(e.value)
    assert msg.startswith("trainer rank 1 died in PolicyTrainer.update (") and "\n" not in msg, msg
    assert msg.endswith(f"the same command resumes from its latest checkpoint (step 3 in {tmp_path})"), msg
    for r in ranks:
        ray.kill(r)

"""The colocated planner (``glm5_mcore.plan.colocate``, ``search.search_rl``): both phases of a GPU by hand,
the 744B colocated search on H100 clusters, and the shipped colocated config's header table = the planner."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30


def compose_rl_preset(name, *overrides):
    """An RL preset (``configs/NAME.yaml``) with ``overrides``, as ``glm5 plan`` reads it (``plan_config``)."""
    from recipes.cli import compose
    from recipes.plan_cli import plan_config

    return plan_config("rl", compose(name, list(overrides), require_all=False))


@pytest.fixture(scope="module")
def shipped():
    from glm5_mcore.config import glm5_744b
    from glm5_mcore.plan.cluster import cluster_from
    from glm5_mcore.plan.job import rl_job
    from glm5_mcore.plan.planner import plan_job

    d = compose_rl_preset("rl/glm5_744b_h100_colocate")
    job = rl_job(d)
    return job, plan_job(glm5_744b(), job, cluster_from(d.plan.cluster))


def test_phases_by_hand(shipped):
    from glm5_mcore.plan.colocate import ENGINE_ASLEEP, ENGINE_CONTEXT, PCIE_GBPS
    from glm5_mcore.plan.rollout import ACTIVATION_RESERVE

    job, plan = shipped
    p, r, ro = plan.phases, plan.worst, job.rollout
    s = r.state
    assert p.training == r.total + ENGINE_ASLEEP
    share = int(80 * GIB * ro.engine.gpu_memory_utilization)
    adapters = s.trainable * 2  # bf16
    assert p.trainer_resident == s.buffers + adapters  # offload_weights: only adapters and buffers stay
    assert p.generation == p.trainer_resident + ENGINE_CONTEXT + share
    assert p.kv_budget == share - p.engine_weights - ACTIVATION_RESERVE
    opt = s.main_params_dist + s.optimizer_dist
    assert p.move_bytes == 2 * opt + 2 * (s.weights - adapters) + 2 * p.engine_weights  # level 1
    assert p.move_seconds == pytest.approx(p.move_bytes / (PCIE_GBPS * 1e9))
    assert p.fits and plan.fits and job.trainer_gpus == 32 and job.rollout_gpus == 0


def test_shipped_header_is_the_planners_table(shipped):
    _, plan = shipped
    p = plan.phases
    head = (ROOT / "configs" / "rl" / "glm5_744b_h100_colocate.yaml").read_text()
    total = re.search(r"#\s+TOTAL\s+([\d.]+)\s+([\d.]+)", head)
    assert (float(total[1]), float(total[2])) == (round(p.training / GIB, 2), round(p.generation / GIB, 2))
    assert f"{p.sequences} sequences" in head and f"{p.move_bytes / GIB:.1f} GiB per GPU" in head
    assert f"{p.kv_budget / GIB:.2f}" in head and f"{p.engine_weights / GIB:.2f}" in head


@pytest.mark.parametrize("cluster", ["h100:4", "h100:8"])
def test_colocated_search_744b_h100(cluster):
    """32 H100s colocated is the fewest; separate engines need 32 + 16 GPUs; nothing larger than the cluster."""
    from glm5_mcore.config import glm5_744b
    from glm5_mcore.plan.cluster import cluster_from
    from glm5_mcore.plan.job import rl_job
    from glm5_mcore.plan.search import search_rl

    c = cluster_from(cluster)
    found = search_rl(glm5_744b(), rl_job(compose_rl_preset("rl/glm5_744b", "rollout.colocate.enable=true")), c,
                      limit=64)
    assert found and found[0].mode == "colocated" and found[0].gpus == 32
    assert [x.gpus for x in found] == sorted(x.gpus for x in found) and max(x.gpus for x in found) <= c.num_gpus
    assert all(x.phases.fits and x.phases.per_gpu <= x.phases.capacity for x in found if x.mode == "colocated")
    sep = [x for x in found if x.mode == "separate"]
    if c.num_gpus >= 48:
        assert sep and min(x.gpus for x in sep) == 48 and sep[0].engine.gpus == 16
    else:
        assert not sep
    assert not any(x.gpus < 32 for x in found)


def test_colocated_plan_names_what_does_not_fit():
    from glm5_mcore.config import glm5_744b
    from glm5_mcore.plan.cluster import cluster_from
    from glm5_mcore.plan.job import rl_job
    from glm5_mcore.plan.planner import plan_job

    d = compose_rl_preset("rl/glm5_744b_h100_colocate", "rollout.colocate.offload_weights=false",
                          "rollout.num_actors=4")
    plan = plan_job(glm5_744b(), rl_job(d), cluster_from("h100:4"))
    text = " | ".join(plan.problems)
    assert "must tile the trainer's 32 GPUs" in text
    assert "colocated generation phase needs" in text and "offload_weights=true" in text


def test_gate_refuses_a_colocated_layout_and_names_the_fewest_that_fit():
    from glm5_mcore.config import glm5_744b
    from glm5_mcore.plan.cluster import cluster_from
    from glm5_mcore.plan.gate import check_job
    from glm5_mcore.plan.job import rl_job

    d = compose_rl_preset("rl/glm5_744b_h100_colocate", "rollout.colocate.offload_weights=false")
    with pytest.raises(ValueError) as e:
        check_job(glm5_744b(), rl_job(d), cluster_from("h100:4"))
    msg = str(e.value)
    assert "colocated generation phase needs" in msg and "fewest GPUs that fit on this cluster:" in msg
    assert "32 GPUs  colocated" in msg and "offload weights" in msg

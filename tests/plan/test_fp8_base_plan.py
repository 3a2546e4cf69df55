"""The planner with a frozen FP8 base (``model.base_dtype=fp8``): 1 byte per element + one fp32 scale per
128x128 block of each linear the release stores in FP8, and the 16 x H100 colocated preset it makes fit
(``configs/rl/glm5_744b_h100_fp8.yaml``: its header = the planner's table; the same layout with a bf16 base
does not fit). The built-rank check is ``tests/plan/test_plan.py::test_planner_equals_built_744b_ranks``."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30
PRESET = "rl/glm5_744b_h100_fp8"


def _plan(*overrides, preset=PRESET):
    from glm5_mcore.config import glm5_744b
    from glm5_mcore.plan.cluster import cluster_from
    from glm5_mcore.plan.job import rl_job
    from glm5_mcore.plan.planner import plan_job
    from recipes.cli import compose
    from recipes.plan_cli import plan_config

    d = plan_config("rl", compose(preset, list(overrides), require_all=False))
    job = rl_job(d)
    return job, plan_job(glm5_744b(), job, cluster_from(d.plan.cluster))


def test_fp8_bytes_by_hand():
    from glm5_mcore.config import glm5_744b
    from glm5_mcore.plan.layout import Layout
    from glm5_mcore.plan.params import stage_tensors

    groups = {g.name: g for g in stage_tensors(glm5_744b(), Layout(16, tp=8, ep=16, cp=2), 0, False)}
    kv_down = groups["linear_kv_down_proj"]  # [576, 6144] replicated: 5 x 48 blocks, the last row-block partial
    assert kv_down.fp8 and kv_down.fp8_bytes == kv_down.count * (576 * 6144 + 4 * 5 * 48)
    assert groups["experts.linear_fc1"].fp8 and groups["linear_wq_b"].fp8
    assert not groups["linear_weights_proj"].fp8 and not groups["router"].fp8 and not groups["embedding"].fp8


@pytest.fixture(scope="module")
def preset():
    return _plan()


def test_fp8_preset_fits_16_h100_and_a_bf16_base_does_not(preset):
    job, plan = preset
    assert job.base_fp8 and job.trainer_gpus == 16 and plan.fits, plan.problems
    p = plan.phases
    assert p.engine_weights < 47 * GIB and p.sequences >= job.rollout.n
    bf16_job, bf16 = _plan("model.base_dtype=null")
    assert not bf16_job.base_fp8 and not bf16.fits
    s8, s16 = plan.worst.state, bf16.worst.state
    assert 0.50 < s8.weights / s16.weights < 0.51  # 1 byte + 1/4096 of scales for ~99% of the weights
    assert bf16.phases.training > p.capacity


def test_fp8_preset_header_is_the_planners_table(preset):
    _, plan = preset
    p = plan.phases
    head = (ROOT / "configs" / f"{PRESET}.yaml").read_text()
    total = re.search(r"#\s+TOTAL\s+([\d.]+)\s+([\d.]+)", head)
    assert (float(total[1]), float(total[2])) == (round(p.training / GIB, 2), round(p.generation / GIB, 2))
    assert f"{p.trainer_weights / GIB:.2f}" in head and f"{p.engine_weights / GIB:.2f}" in head
    assert f"{p.sequences} sequences" in head and f"{p.move_bytes / GIB:.1f} GiB per GPU" in head
    assert f"{p.kv_budget / GIB:.2f}" in head and f"{p.kv_group / GIB:.2f}" in head
    _, bf16 = _plan("model.base_dtype=null")
    assert f"needs {bf16.phases.training / GIB:.1f} GiB per GPU in the training phase" in head
    h = plan.host
    assert f"training phase {h.total('training') / GIB:.2f}" in head
    assert f"generation phase\n# {h.total('generation') / GIB:.2f}" in head
    assert f"copy of one FP8 module inside its backward: {plan.worst.te_copy / GIB:.2f}" in head


def test_full_fine_tuning_with_an_fp8_base_is_refused_by_the_planner():
    from glm5_mcore.plan.memory import state_bytes

    with pytest.raises(ValueError, match="model.base_dtype=fp8: the frozen FP8 base is for LoRA"):
        state_bytes([], [], bf16=True, full_ft=True, freeze_indexer=True, dp_cp=1, expert_dp=1, base_fp8=True)


def test_744b_full_stack_lora_rl_fits_one_h200_node_and_its_header_is_the_plan():
    """``configs/rl/glm5_744b_h200_1node.yaml``: every family vLLM serves as LoRA (the routed experts included) on
    one 8 x H200 node with 2 TB of RAM, colocated, FP8 base: both phases fit per GPU and per node (host memory
    counted); the header is the planner's table; a bf16 base does not fit."""
    job, plan = _plan(preset="rl/glm5_744b_h200_1node")
    assert plan.fits and job.trainer_gpus == 8 and plan.cluster.num_gpus == 8, plan.problems
    assert "experts.linear_fc1" in job.rollout.engine.lora_families and not job.rollout.merge
    p, h = plan.phases, plan.host
    head = (ROOT / "configs" / "rl" / "glm5_744b_h200_1node.yaml").read_text()
    total = re.search(r"#\s+TOTAL\s+([\d.]+)\s+([\d.]+)", head)
    assert (float(total[1]), float(total[2])) == (round(p.training / GIB, 2), round(p.generation / GIB, 2))
    assert f"{p.sequences} sequences" in head and f"{p.move_bytes / GIB:.1f} GiB per GPU" in head
    assert f"{plan.lora_buffers / GIB:.2f} of it LoRA buffers" in head
    assert f"training phase {h.total('training') / GIB:.2f}" in head and h.fits
    assert not _plan("model.base_dtype=null", preset="rl/glm5_744b_h200_1node")[1].fits

"""``glm5 plan``'s host memory per node in each phase (``glm5_mcore.plan.host``) and the GPU line of a TE FP8 base
(1 byte a parameter + the column-wise copy of one module inside its backward, ``glm5_mcore.model.fp8_te``), on the
16 x H100 FP8 preset: the arena the colocated offload keeps, vLLM's level-1 sleep copy, the offloaded optimizer
state and the processes, against a node's RAM (``--host-mem-gib``, the preset's 2048 GiB by default)."""

import pytest

from glm5_mcore.plan.host import HOST_PROCESS

PRESET = "rl/glm5_744b_h100_fp8"
GIB = 1 << 30


def _plan(*overrides):
    from glm5_mcore.config import glm5_744b
    from glm5_mcore.plan.cluster import cluster_from
    from glm5_mcore.plan.job import rl_job
    from glm5_mcore.plan.planner import plan_job
    from recipes.cli import compose
    from recipes.plan_cli import plan_config

    cfg = plan_config("rl", compose(PRESET, list(overrides), require_all=False))
    return plan_job(glm5_744b(), rl_job(cfg), cluster_from(cfg.plan.cluster))


@pytest.fixture(scope="module")
def preset():
    return _plan()


def test_host_memory_per_node_of_the_fp8_preset_in_both_phases(preset):
    h, p, s = preset.host, preset.phases, preset.worst.state
    gpus = preset.cluster.gpus_per_node
    frozen = s.weights - 2 * s.trainable  # the FP8 base HostCopy moves: every frozen weight (bf16 adapters stay)
    opt = s.main_params_dist + s.optimizer_dist
    served = sum(v for k, v in preset.push.items() if not k.startswith("merged:"))  # LoRA mode: the adapter,
    lora = served + 2 * preset.lora_buffers  # and vLLM's CPU cache of max_loras + 1 = 2 versions, each <= a slot
    want = {"trainer processes": (HOST_PROCESS, HOST_PROCESS), "engine workers": (HOST_PROCESS, HOST_PROCESS),
            "frozen base, offloaded (HostCopy arena)": (frozen, frozen),
            "optimizer state, offloaded": (0, opt), "engine weights, asleep (level 1)": (p.engine_weights, 0),
            "engine LoRA adapters (push + vLLM's CPU cache)": (0, lora)}
    assert h.rows == {k: {"training": a * gpus, "generation": b * gpus} for k, (a, b) in want.items()}
    assert h.pinned == {"training": gpus * (frozen + p.engine_weights), "generation": gpus * frozen}
    assert 11e9 < served < 12e9 and 0.9 * GIB < preset.lora_buffers < 1.0 * GIB  # rank 16, every expert's adapter
    assert 795 * GIB < h.total("training") < 805 * GIB and 565 * GIB < h.total("generation") < 580 * GIB
    assert h.fits and preset.fits and preset.cluster.host_mem_gib == 2048
    level2 = _plan("rollout.colocate.sleep_level=2").host  # vLLM discards its weights: nothing asleep on the host
    assert "engine weights, asleep (level 1)" not in level2.rows
    assert level2.total("training") == h.total("training") - gpus * p.engine_weights


def test_a_node_without_the_ram_is_refused_naming_the_phase(capsys):
    """``glm5 plan --host-mem-gib 512``: the preset's training phase does not fit a node, and the verdict says so."""
    import argparse

    from recipes.plan_cli import add_arguments, run

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert run(ap.parse_args(["--config", PRESET, "--host-mem-gib", "512"])) == 1
    out = capsys.readouterr().out
    assert ("verdict: does not fit\n  - host memory: the training phase needs 801 GiB per node, a node has 448 GiB "
            "usable (512 GiB less 64 reserved; --host-mem-gib sets a node's RAM)") in out, out[-1500:]


def test_the_te_fp8_base_is_one_byte_a_parameter_plus_one_modules_copy_in_backward(preset):
    """The largest FP8 module of a rank at EP 16 is a MoE layer's grouped fc1: 16 local experts of [2 x 2048, 6144]
    e4m3 + fp32 128x128 block scales, whose column-wise copy TE makes inside that module's backward."""
    assert preset.worst.te_copy == 16 * (4096 * 6144 + 4 * 32 * 48)
    assert _plan("trainer.backend=local").worst.te_copy == 0  # the local spec's FP8 base makes no copy
    dense = _plan("model.base_dtype=null").worst
    assert dense.te_copy == 0 and 0.50 < preset.worst.state.weights / dense.state.weights < 0.51

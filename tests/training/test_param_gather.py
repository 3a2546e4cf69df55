"""``overlap_param_gather`` (issue 28 D3): Megatron DDP's parameter all-gather overlapped with the next forward,
with the forced sync before saves, evaluations and adapter exports (``training.loop.synced_params``)."""


import pytest

from tests.support.launch import last_json, torchrun


@pytest.mark.slow
def test_overlap_param_gather_syncs_before_saves_and_evaluation(tiny_dir, tmp_path):
    """DP 2 on gloo with Megatron's distributed optimizer. Right after a step under the overlap the other rank's
    shard is stale (so the forced sync is needed, and the test can fail); inside ``synced_params`` the parameters
    equal the run without the overlap exactly, and so do the next step's loss (its forward gathers them) and the
    parameters synced after it. The SFT recipe with the overlap gives the same
    losses, validation losses and saved weights as without it."""
    res = last_json(torchrun("param_gather_check.py", tiny_dir, tmp_path / "out").stdout)
    s = res["steps"]
    assert s["ddp_flag"] == [False, True] and s["hooks"][0] == 0 and s["hooks"][1] > 0
    assert s["stale"] > 1e-4, s  # the step really left the gather to the next forward
    assert s["synced"] == 0.0 and s["final"] == 0.0, s
    assert s["losses"][0] == s["losses"][1]
    sft = res["sft"]
    assert len(sft["loss"][0]) == 4 and sft["loss"][0] == sft["loss"][1], sft
    assert [v for _, v in sft["val"][0]] == [v for _, v in sft["val"][1]] and len(sft["val"][0]) >= 2, sft
    assert sft["saved"] == {"2": 0.0, "4": 0.0}, sft


@pytest.mark.slow
def test_overlap_param_gather_gathers_the_lora_adapters(tiny_dir, tmp_path):
    """Issue 39 G3: LoRA at DP 2 on gloo with the distributed optimizer. The adapters' forward waits for their
    bucket's all-gather (DDP's pre-hook fires only on a module called in the forward that directly holds the
    parameter), so the losses and the synced adapters equal the run without the overlap; with the adapters in a
    ParameterDict that is never called, steps 2 and 3 ran on the other rank's stale adapter shards."""
    res = last_json(torchrun("param_gather_check.py", tiny_dir, tmp_path / "out", "lora").stdout)["lora"]
    assert res["n"] > 0 and len(res["losses"][0]) == 3, res
    assert res["losses"][0] == res["losses"][1] and res["final"] == 0.0, res


def test_overlap_param_gather_needs_the_distributed_optimizer(tiny_dir, single_rank, tmp_path):
    """Without the distributed optimizer there is no parameter all-gather to overlap: refused in one line naming the
    field, by the SFT config check (before any work) and by ``build_trainer``; the DDP and optimizer configs get
    the flag when it is on."""
    from glm5_mcore.training.loop import OptimCfg, build_trainer, check_optimizer
    from recipes.sft import validate
    from tests.support.helpers import hf_model
    from tests.support.sft_setup import sft_cfg

    model, glm5 = hf_model(tiny_dir)
    with pytest.raises(ValueError, match=r"^optim\.overlap_param_gather: needs Megatron's distributed optimizer"):
        build_trainer(model, OptimCfg(overlap_param_gather=True), 1)
    with pytest.raises(ValueError, match=r"^actor\.overlap_param_gather"):
        check_optimizer(OptimCfg(overlap_param_gather=True), 4, "actor")
    cfg = sft_cfg(tiny_dir, tmp_path, optim={"overlap_param_gather": True})
    with pytest.raises(ValueError, match=r"^optim\.overlap_param_gather"):
        validate(cfg, glm5, 1)
    ddp, opt, _ = build_trainer(model, OptimCfg(distributed=True, overlap_param_gather=True), 1)
    assert ddp.ddp_config.overlap_param_gather and opt.config.overlap_param_gather
    assert ddp.ddp_config.use_distributed_optimizer and len(ddp.remove_forward_pre_hook_handles) > 0

"""vLLM's LoRA mode without vLLM (``rl.rollout.vllm_lora``, ``rl.rollout.vllm_push``, a recording server): what
travels as a LoRA adapter and what is merged, vLLM's limits refused before Ray, adapter versions that let a push
through while requests are live, and what a merged FP8 push keeps of a small adapter (the real engine:
``tests/rl/test_vllm_certificate.py``)."""

import pytest
import torch

from rl.rollout.base import Request
from tests.support.certificate import keep_families, randomize_adapters
from tests.support.vllm_stub import recording_engine


@pytest.fixture(scope="module")
def full_stack(tiny_dir):
    """A trainer with an adapter on every family RL trains (the indexer is frozen in RL), B random, and its B's."""
    from glm5_mcore.lora.config import EXPERTS, MLA, MLP
    from rl.config import RLConfig
    from rl.train.trainer import PolicyTrainer

    cfg = RLConfig.from_dict({"model": {"hf_dir": tiny_dir}, "wandb": {"mode": "disabled"},
                              "lora": {"targets": list(MLA + MLP + EXPERTS)}})
    trainer = PolicyTrainer(cfg)
    return trainer, randomize_adapters(trainer.model, seed=3, scale=0.1)


def _payload(trainer, saved, families, version):
    keep_families(trainer.model, saved, families)
    return trainer.export_adapter(version)


def test_lora_mode_serves_every_family_vllm_has_a_lora_layer_for(full_stack):
    """Routed experts (PEFT's 3D form), MLA q_a / kv_a / q_b / o, dense and shared MLP, the indexer's wq_b travel as
    the LoRA adapter; kv_b_proj, the indexer's wk / weights_proj (and the MTP layer) never do; no-op modules
    (B zero) are left out; under dense_mla the indexer is dropped."""
    import json

    from safetensors.torch import load

    from glm5_mcore.lora.peft import peft_files, peft_state
    from rl.rollout.vllm_lora import lora_mode_part, served_adapter

    trainer, saved = full_stack
    L = trainer.glm5.num_hidden_layers
    files = _payload(trainer, saved, ["mla", "kv_b_proj", "dense", "shared", "routed"], 1).files
    state = peft_state(json.loads(files["adapter_config.json"]), load(files["adapter_model.safetensors"]), L)
    indexer = _adapter_on(trainer.cfg.model.hf_dir, [f"decoder.layers.{i}.self_attention.core_attention.indexer."
                                                     f"linear_{x}" for i in range(L) for x in ("wq_b", "wk", "weights_proj")],
                          0.1)  # an SFT sparse stage's adapter (RL keeps the indexer frozen)
    for m in indexer.modules():
        state.A[m], state.B[m], state.scale[m] = indexer.A[m], indexer.B[m], indexer.scale[m]

    class payload:  # noqa: N801 - what the trainer pushes, with the indexer's adapters too
        files = peft_files(state, L, trainer.glm5.n_routed_experts)

    served = served_adapter(payload.files, L)
    leaves = {m.split(".", 1)[1] if m.startswith("self_attn.") else m for m in served.modules}
    for want in ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "o_proj", "indexer.wq_b", "mlp.gate_proj",
                 "mlp.down_proj", "mlp.shared_experts.gate_proj", "mlp.experts.base_layer", "mlp.experts"):
        assert want in leaves, (want, sorted(leaves))
    assert not any(x in m for m in served.modules for x in ("kv_b_proj", "indexer.wk", "weights_proj")), served.modules
    assert served.routed and {"experts.gate_up_proj", "experts.down_proj"} <= set(served.config["target_parameters"])
    assert not {"kv_b_proj", "wk", "weights_proj"} & set(served.config["target_modules"])
    assert not any("indexer" in m for m in served_adapter(payload.files, L, dense_mla=True).modules)
    assert lora_mode_part(f"model.layers.{L}.self_attn.q_b_proj.weight", L) == "draft"
    assert served_adapter(_payload(trainer, saved, ["kv_b_proj"], 2).files, L) is None  # merged only
    mla_only = served_adapter(_payload(trainer, saved, ["mla"], 3).files, L)  # B zero elsewhere: not sent
    assert mla_only.nbytes < served.nbytes and not mla_only.routed and all("mlp" not in m for m in mla_only.modules)


def test_vllm_limits_on_lora_mode_are_refused_in_one_line():
    from glm5_mcore.lora.config import VLLM_LORA
    from rl.rollout.vllm_lora import MERGED_FAMILIES, VLLM_MODULES, check_lora_mode, lora_job_kwargs

    assert set(VLLM_MODULES) == set(VLLM_LORA) and MERGED_FAMILIES == ("linear_kv_up_proj", "linear_wk",
                                                                         "linear_weights_proj")
    routed = ["linear_proj", "experts.linear_fc1"]
    check_lora_mode({"max_lora_rank": 16}, 16, routed)
    check_lora_mode({"merge": True, "max_lora_rank": 24}, 16, routed)  # merged mode: no LoRA limits
    check_lora_mode({"enable_expert_parallel": True}, 16, routed)  # vLLM's default all-to-all
    check_lora_mode({"enable_expert_parallel": True, "all2all_backend": "deepep_low_latency"}, 16, ["linear_proj"])
    check_lora_mode({"quantization": "fp8"}, 16, routed)  # LoRA mode on an FP8 engine: the delta stays exact
    bad = [({"max_lora_rank": 24}, 16, r"max_lora_rank=24: vLLM 0.32 takes one of \[1, 8, 16"),
           ({"max_lora_rank": 8}, 16, r"max_lora_rank=8 is below the adapter's rank 16"),
           ({"enable_expert_parallel": True, "all2all_backend": "deepep_low_latency"}, 16,
            r"all2all_backend='deepep_low_latency': .*allgather_reducescatter"),
           ({"enable_expert_parallel": True, "all2all_backend": "allgather_reducescatter",
             "fully_sharded_loras": True}, 16, r"fully_sharded_loras=true: vLLM refuses it with expert parallelism"),
           ({"moe_backend": "deep_gemm"}, 16, r"moe_backend='deep_gemm': .*only the MoE kernels that take LoRA"),
           ({"quantization": "fp8", "merge": True}, 16, r"merged into the weights of an FP8 engine .* merge: false"),
           ({"quantization": "fp8"}, 16, r"\['linear_kv_up_proj'\]: merged into the weights of an FP8 engine")]
    for kwargs, rank, msg in bad:
        with pytest.raises(ValueError, match=msg) as e:
            check_lora_mode(kwargs, rank, routed + ["linear_kv_up_proj"] * ("quantization" in kwargs))
        assert "\n" not in str(e.value)
    got = lora_job_kwargs({"max_lora_rank": 16}, ["linear_q_up_proj", "linear_kv_up_proj", "experts.linear_fc2"], 2)
    assert got["max_loras"] == 3 and got["lora_target_modules"] == ["experts", "q_b_proj"]  # kv_b_proj: merged
    assert lora_job_kwargs({"max_loras": 1}, ["linear_proj"], 2)["max_loras"] == 1  # the user's setting stays
    assert "max_loras" not in lora_job_kwargs({"merge": True}, ["linear_proj"], 2)


def test_a_lora_push_goes_in_while_requests_are_live_and_old_versions_leave_once_unused(full_stack, tiny_dir,
                                                                                         tmp_path):
    """LoRA mode: a push of served families is installed at once under live stream requests (they keep their
    version's adapter); a version leaves vLLM when neither the newest nor used; a push that merges (kv_b_proj)
    waits for the live requests, as a merged push always does."""
    trainer, saved = full_stack
    e = recording_engine(tiny_dir, tmp_path, merge=False)
    served = ["mla", "dense", "routed"]
    e.load_adapter(_payload(trainer, saved, served, 1))
    assert [m for m, _ in e.server.calls] == ["add_adapter"] and e.lora[1] == 1 and e.lora[2] is True
    e.stream.live["glm5-s1"] = (Request((0, 0), [3, 4], 1), 1)  # a request admitted under v1
    e.load_adapter(_payload(trainer, saved, served, 2))
    assert e._deferred is None and not e.stream.hold and e.lora[1] == 2  # no wait, v1 kept for its request
    assert [m for m, _ in e.server.calls] == ["add_adapter", "add_adapter"] and e.last_push()["waited"] is False
    del e.stream.live["glm5-s1"]
    e._retire()
    assert e.server.calls[-1] == ("remove_adapter", 1) and set(e.adapters.by_version) == {2}
    e.stream.live["glm5-s2"] = (Request((1, 0), [3, 4], 2), 2)
    e.load_adapter(_payload(trainer, saved, ["kv_b_proj"], 3))  # merged: changes the weights live requests use
    assert e._deferred is not None and e.stream.hold and len(e.server.calls) == 3
    del e.stream.live["glm5-s2"]
    e._install_deferred()
    assert [m for m, _ in e.server.calls[3:]] == ["reload", "remove_adapter"] and e.lora is None
    assert e.last_push()["waited"] is True and e.last_push()["merged_bytes"] > 0
    e.load_adapter(_payload(trainer, saved, served, 4))  # kv_b_proj back to base: a reload, nothing live
    assert [m for m, _ in e.server.calls[5:]] == ["reload", "add_adapter"] and not e.weights.pushed


def _adapter_on(hf_dir, modules: list, ratio: float, seed: int = 0):
    """An ``AdapterState`` with rank-4 adapters on ``modules`` (Megatron names), each ‖scale·B·A‖ = ratio·‖W‖."""
    from glm5_mcore.checkpoint.hf_io import HFCheckpoint
    from glm5_mcore.checkpoint.hf_names import hf_source
    from glm5_mcore.lora.state import AdapterState

    base, g, st = HFCheckpoint(hf_dir), torch.Generator().manual_seed(seed), AdapterState()
    for m in modules:
        w = torch.cat([base.get(h).float() for h in hf_source(m + ".weight", 4).names])
        a, b = torch.randn(4, w.shape[1], generator=g), torch.randn(w.shape[0], 4, generator=g)
        st.A[m], st.B[m], st.scale[m] = a, b * (ratio * w.norm() / (b @ a).norm()), 1.0
    return st


def test_a_merged_fp8_push_reports_what_it_keeps_and_refuses_a_rounded_away_adapter(tmp_path):
    """H6: re-quantizing W + ΔW to e4m3 keeps a few per cent of a small adapter (‖ΔW‖/‖W‖ = 1e-3): the push says
    so per family and is refused in one line; a large one passes; the push's blocks are the folder's own."""
    from glm5_mcore.checkpoint.hf_io import HFCheckpoint
    from rl.rollout.vllm_weights import merged_delta_kept, merged_weights
    from tests.support.helpers import fp8_folders

    fp8, dense = fp8_folders(tmp_path)  # 16 x 16 blocks
    mods = ["decoder.layers.0.self_attention.linear_proj", "decoder.layers.1.mlp.experts.local_experts.3.linear_fc1"]
    kept: dict = {}
    got = merged_weights(fp8, _adapter_on(fp8, mods, 1e-3), kept=kept, kept_min=0.0)
    h = "model.layers.0.self_attn.o_proj.weight"
    assert got[h + "_scale_inv"].shape == HFCheckpoint(fp8).get_stored(h)[1].shape  # the folder's 16-blocks
    small = merged_delta_kept(kept)
    assert set(small) == {"linear_proj", "experts.linear_fc1"} and max(small.values()) < 0.15, small
    with pytest.raises(ValueError, match=r"^merged FP8 push: (linear_proj|experts.linear_fc1) keeps \d+\.\d% of the "
                                         r"adapter's delta \(< 90%\).*merge: false\) or take .* out of lora.targets$"):
        merged_weights(fp8, _adapter_on(fp8, mods, 1e-3))
    kept = {}
    merged_weights(fp8, _adapter_on(fp8, mods, 0.3), kept=kept)  # a large delta survives e4m3
    assert min(merged_delta_kept(kept).values()) > 0.9, kept
    kept = {}
    merged_weights(dense, _adapter_on(dense, mods, 1e-3), kept=kept)  # fp32 folder: kept whole, never refused
    assert min(merged_delta_kept(kept).values()) > 0.999, kept

"""Device bugs caught on CPU: the model, the SFT and RL data paths and their losses run on a stand-in
accelerator (``glm5_mcore/probes/fake_device.py``: tensors on ``meta`` holding CPU values), where a tensor made
on the CPU inside them fails as it would on CUDA; collectives must get training-device tensors."""

import json

import pytest
import torch

from glm5_mcore.probes.fake_device import fake_device, host

from glm5_mcore.config import GLM5Config
from glm5_mcore.mcore_settings import ParallelConfig
from glm5_mcore.lora.config import FAMILIES, LoRAConfig

from tests.support.launch import last_json, torchrun


def _docs(hf_dir, tmp_path):
    from transformers import AutoTokenizer

    from glm5_mcore.data.sft import read_jsonl

    with open(tmp_path / "d.jsonl", "w") as f:
        for i in range(3):
            f.write(json.dumps({"prompt": " ".join(f"w{(i * 7 + k) % 90}" for k in range(5 + 4 * i)),
                                "response": f"w{i} w{i + 1} w{i + 2} w{i + 3}"}) + "\n")
    return read_jsonl(tmp_path / "d.jsonl", AutoTokenizer.from_pretrained(hf_dir), 64)


def _sft_loss_and_grads(hf_dir, batch):
    """One SFT micro-batch through ``recipes.sft._forward_step`` (the data path, the model with LoRA on
    every family, MTP, DSA, THD) and its loss function; (loss, n, {param: grad}) as CPU values."""
    from glm5_mcore.device import training_device
    from glm5_mcore.lora.apply import apply_lora
    from glm5_mcore.model.build import build_model
    from glm5_mcore.checkpoint.hf_load import load_hf_weights
    from glm5_mcore.model.mtp_loss import mtp_depth_losses
    from recipes.sft import _forward_step

    glm5 = GLM5Config.from_hf_dir(hf_dir)
    m = build_model(glm5, ParallelConfig())
    dev = training_device()
    off = [n for n, t in [*m.named_parameters(), *m.named_buffers()] if t.device.type != dev.type]
    assert not off, f"build_model left {len(off)} tensors off the training device {dev}: {off[:6]}"
    load_hf_weights(m, hf_dir, glm5)
    apply_lora(m, LoRAConfig(rank=2, targets=FAMILIES, init="random", seed=3), "default", freeze_indexer=False)
    off = [n for n, p in m.named_parameters() if p.device.type != dev.type]
    assert not off, f"LoRA adapters off the training device {dev}: {off[:6]}"
    m.train()
    mtp_depth_losses(1)  # clear the tracker
    out, loss_func = _forward_step(iter([batch]), m)
    loss, n, _ = loss_func(out)
    loss.backward()
    assert mtp_depth_losses(1).get("mtp_loss/depth_1", 1) > 0  # the MTP layer ran
    grads = {k: host(p.grad).clone() for k, p in m.named_parameters() if p.grad is not None}
    return float(host(loss)), int(host(n)), grads


@pytest.fixture()
def default_loss_scales(monkeypatch):
    """Megatron's auxiliary-loss scalers at their import-time defaults: an SFT run earlier in this
    process (Megatron's schedule sets them per step) leaves a [1] CPU tensor there, which the
    stand-in device rightly refuses; ``_sft_loss_and_grads`` runs no schedule to set them."""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    monkeypatch.setattr(MTPLossAutoScaler, "main_loss_backward_scale", torch.tensor(1.0))
    monkeypatch.setattr(MoEAuxLossAutoScaler, "main_loss_backward_scale", None)
    monkeypatch.setattr(DSAIndexerLossAutoScaler, "main_loss_backward_scale", None)


def test_sft_forward_backward_on_a_device_matches_cpu(tiny_mtp_dir, tmp_path, single_rank, default_loss_scales):
    from glm5_mcore import kernels
    from glm5_mcore.data.sft import pack

    batch = pack(_docs(tiny_mtp_dir, tmp_path), 1000)[0]
    assert len(batch.cu_seqlens) == 4
    with kernels.disabled():  # the PyTorch DSA path on both sides, as on CUDA
        ref_loss, ref_n, ref_grads = _sft_loss_and_grads(tiny_mtp_dir, batch)
    with fake_device():
        loss, n, grads = _sft_loss_and_grads(tiny_mtp_dir, batch)
    assert n == ref_n and abs(loss - ref_loss) <= 1e-5 * abs(ref_loss), (loss, ref_loss)
    lora = [k for k in ref_grads if ".lora." in k]
    assert set(grads) == set(ref_grads) and lora
    worst = max((float((grads[k] - g).abs().max()), k) for k, g in ref_grads.items())
    assert worst[0] <= 1e-5, sorted(((float((grads[k] - g).abs().max()), k) for k, g in ref_grads.items()), reverse=True)[:12]


def test_rl_trainer_on_a_device_matches_cpu(tiny_dir):
    """The RL trainer (policy + GAE critic with its value head) builds, computes log-probs / values and
    updates on the device; results equal the CPU trainer's."""
    from glm5_mcore.device import training_device
    from rl.train import algos
    from rl.train.batch import RolloutBatch
    from rl.config import RLConfig
    from rl.train.batch import fill_log_probs
    from rl.train.trainer import PolicyTrainer

    cfg = RLConfig.from_dict({"model": {"hf_dir": tiny_dir}, "wandb": {"mode": "disabled"},
                              "algorithm": {"adv_estimator": "gae"}, "rollout": {"n": 2},
                              "actor": {"ppo_mini_batch_size": 2}})
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (6 + 5 * (i // 2),), generator=g).tolist() for i in range(4)]
    responses = [torch.randint(3, 90, (4,), generator=g).tolist() for _ in range(4)]

    def run():
        batch = RolloutBatch.build(prompts, responses, [[-1.0] * 4] * 4, [0, 0, 1, 1])
        batch.scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
        t = PolicyTrainer(cfg)
        dev = training_device()
        off = [n for n, p in t.model.named_parameters() if p.device.type != dev.type]
        assert not off, f"trainer parameters off the training device {dev}: {off[:6]}"
        lp = t.compute_log_probs(batch)
        fill_log_probs(batch, [lp])
        batch.rollout_log_probs = batch.old_log_probs - 0.01
        algos.rollout_correction(cfg, batch)
        algos.compute_advantages(cfg, batch, 0.0)
        return lp, t.update(batch, step=0)

    from glm5_mcore import kernels

    with kernels.disabled():
        ref_lp, ref_m = run()
    with fake_device():
        lp, m = run()
    for k in ("old_log_probs", "ref_log_probs", "values"):
        assert (lp[k] - ref_lp[k]).abs().max() <= 1e-5, (k, lp[k], ref_lp[k])
    assert m["actor/updates_skipped"] == 0.0
    assert abs(m["actor/grad_norm"] - ref_m["actor/grad_norm"]) <= 1e-4 * ref_m["actor/grad_norm"]


@pytest.mark.slow
def test_collectives_of_sft_rl_and_parity_get_training_device_tensors(tiny_dir, tmp_path):
    """Two gloo ranks on the stand-in device: every collective SFT (EP2 × DP2), the RL trainer (DP2)
    and parity (CP2, TP2) issue — theirs and Megatron-Core's — gets tensors on the training device."""
    data = tmp_path / "d.jsonl"
    with open(data, "w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": " ".join(f"w{(i * 7 + k) % 90}" for k in range(3 + i % 5)),
                                "response": f"w{i} w{i + 1} w{i + 2}"}) + "\n")
    res = last_json(torchrun("device_collectives_check.py", tiny_dir, data, tmp_path / "sft", timeout=900).stdout)
    print(json.dumps(res, indent=1))
    assert not res["violations"], "\n".join(res["violations"])
    callers = " ".join(res["callers"])
    for where in ("recipes/sft.py", "rl/train/trainer.py", "glm5_mcore/parity.py", "megatron/core/distributed"):
        assert where in callers, (where, res["callers"])


def test_host_copy_uses_one_arena_reused_every_cycle():
    """G10: ``HostCopy`` moves every storage into ONE host arena (page-aligned offsets; pinned with
    ``cudaHostRegister`` on its exact size under CUDA), made at the first offload and reused: not a pinned buffer
    per storage (PyTorch's pinned allocator rounds each to a power of two and caches it). Views and shared
    storages come back bit-identical."""
    from glm5_mcore.device import HOST_ALIGN, HostCopy

    g = torch.Generator().manual_seed(0)
    a = torch.randn(1000, generator=g)
    b = torch.randn(3, 77, generator=g).to(torch.bfloat16)
    view = a[10:20]  # shares a's storage: moved once
    want = [t.clone() for t in (a, b, view)]
    hc = HostCopy([a, b, view])
    assert len(hc.tensors) == 2
    assert hc.host_bytes == -(-4000 // HOST_ALIGN) * HOST_ALIGN + -(-462 // HOST_ALIGN) * HOST_ALIGN
    ptrs = []
    for _ in range(3):
        assert hc.offload() == 4000 + 462 and a.untyped_storage().nbytes() == 0 == b.untyped_storage().nbytes()
        assert hc.arena.numel() == hc.host_bytes
        ptrs.append(hc.arena.data_ptr())
        assert hc.restore() == 4000 + 462
        assert all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip((a, b, view), want))
    assert len(set(ptrs)) == 1  # the same arena every cycle

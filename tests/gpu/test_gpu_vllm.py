"""vLLM rollout engine on a tiny GLM-5 with GLM-5's real MLA widths (GPU only; skipped without CUDA/vLLM).

vLLM's MLA kernels take the latent width kv_lora_rank + qk_rope_head_dim = 512 + 64 = 576 (and its
DSA indexer kernels index_head_dim 128) and run in bf16: the model here keeps the tiny depth, hidden
size and vocabulary but GLM-5's attention widths, and both sides run bf16 (the trainer's output
projection in fp32, ``fp32_output_layer``)."""

import dataclasses
import importlib.util

import pytest
import torch

from tests.support.rl_setup import gpu_rl_dict, perturb

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (GPU extra)"),
]

BF16_MEAN_ABS = 2e-2
"""mean |trainer - vLLM| log-prob over sampled tokens: both bf16 (different kernels, same weights)."""


@pytest.fixture(scope="module")
def mla576_dir(tmp_path_factory):
    from glm5_mcore.config import glm5_744b, glm5_tiny
    from glm5_mcore.tiny import random_hf_state_dict, write_hf_checkpoint

    real = glm5_744b()
    cfg = dataclasses.replace(glm5_tiny(), kv_lora_rank=real.kv_lora_rank, qk_rope_head_dim=real.qk_rope_head_dim,
                              qk_nope_head_dim=real.qk_nope_head_dim, v_head_dim=real.v_head_dim,
                              q_lora_rank=256, index_head_dim=real.index_head_dim, torch_dtype="bfloat16")
    assert cfg.kv_lora_rank + cfg.qk_rope_head_dim == 576
    sd = {k: v.to(torch.bfloat16) for k, v in random_hf_state_dict(cfg, seed=0).items()}
    return str(write_hf_checkpoint(cfg, sd, tmp_path_factory.mktemp("ckpt") / "tiny_mla576"))


@pytest.mark.parametrize("merge", [False, True])
def test_vllm_engine_samples_with_logprobs_close_to_trainer(mla576_dir, merge):
    from transformers import AutoTokenizer

    from rl.config import RLConfig
    from rl.train.batch import fill_log_probs, make_batch
    from rl.rollout.base import Request, SamplingParams, sample_seed
    from rl.rollout.vllm_engine import VLLMRolloutEngine
    from rl.tasks.prompts import toy_prompts
    from rl.train.trainer import PolicyTrainer

    cfg = RLConfig.from_dict(gpu_rl_dict(mla576_dir))
    trainer = PolicyTrainer(cfg)
    assert all(p.is_cuda for p in trainer.model.parameters())
    perturb(trainer, scale=0.2)  # B != 0: the push must carry the adapter (a zero B serves the base either way)
    engine = VLLMRolloutEngine(mla576_dir, merge=merge, dtype="bfloat16", gpu_memory_utilization=0.3)
    engine.load_adapter(trainer.export_adapter(1))
    tok = AutoTokenizer.from_pretrained(mla576_dir)
    prompts = toy_prompts(tok, 4, 0)
    reqs = [Request((p.index, k), p.ids, sample_seed(0, 0, p.index, k)) for p in prompts for k in range(2)]
    res = engine.generate(reqs, SamplingParams(1.0, 1.0, 8, ()))
    assert all(len(r.response_ids) == 8 == len(r.logprobs) for r in res)
    batch = make_batch(prompts, res, 2)
    fill_log_probs(batch, [trainer.compute_log_probs(batch)])
    diff = (batch.old_log_probs - batch.rollout_log_probs)[batch.response_mask.bool()].abs()
    print(f"vLLM vs trainer (bf16, merge={merge}): mean |diff| {float(diff.mean()):.3g}, max {float(diff.max()):.3g}")
    assert float(diff.mean()) < BF16_MEAN_ABS, float(diff.mean())


def test_vllm_returns_routes_and_trainer_replays_them(mla576_dir):
    """R3 with vLLM: ``return_routes`` (enable_return_routed_experts) gives uint8 [P + n - 1, moe_layers,
    top_k] per sample; the trainer replays them and its own choices mostly agree (bf16 on both sides)."""
    from transformers import AutoTokenizer

    from rl.config import RLConfig
    from rl.train.batch import fill_log_probs, make_batch
    from rl.rollout.base import Request, SamplingParams, sample_seed
    from rl.rollout.vllm_engine import VLLMRolloutEngine
    from rl.train.routing import router_metrics
    from rl.tasks.prompts import toy_prompts
    from rl.train.trainer import PolicyTrainer

    cfg = RLConfig.from_dict(gpu_rl_dict(mla576_dir, algorithm={"router_replay": True}))
    trainer = PolicyTrainer(cfg)
    perturb(trainer, scale=0.2)  # B != 0 (B3)
    engine = VLLMRolloutEngine(mla576_dir, merge=True, dtype="bfloat16", gpu_memory_utilization=0.3,
                               return_routes=True)
    engine.load_adapter(trainer.export_adapter(1))
    tok = AutoTokenizer.from_pretrained(mla576_dir)
    prompts = toy_prompts(tok, 4, 0)
    reqs = [Request((p.index, k), p.ids, sample_seed(0, 0, p.index, k)) for p in prompts for k in range(2)]
    res = engine.generate(reqs, SamplingParams(1.0, 1.0, 8, ()))
    L, k = sum(trainer.glm5.moe_layer_pattern), trainer.glm5.num_experts_per_tok
    for r, p in zip(res, [p for p in prompts for _ in range(2)]):
        assert r.routes is not None and r.routes.dtype.itemsize == 1
        assert r.routes.shape == (len(p.ids) + len(r.response_ids) - 1, L, k), r.routes.shape
    batch = make_batch(prompts, res, 2)
    out = trainer.compute_log_probs(batch)
    fill_log_probs(batch, [out])
    agree = router_metrics([out])["rollout_corr/router_agree"]
    diff = (batch.old_log_probs - batch.rollout_log_probs)[batch.response_mask.bool()].abs()
    print(f"vLLM routes replayed: router_agree {agree:.4f}, mean |diff| {float(diff.mean()):.3g}")
    assert agree > 0.8, agree
    assert float(diff.mean()) < BF16_MEAN_ABS, float(diff.mean())


@pytest.mark.parametrize("merge", [True, False])
def test_vllm_engine_drafts_with_the_mtp_layer(tmp_path, merge):
    """``engine_kwargs.mtp_draft_tokens``: vLLM serves the checkpoint's MTP layer as the speculative
    draft (``speculative_config`` method "mtp") and still samples with log-probs; each push merges the
    trained MTP layer's adapter into the draft model — merged and LoRA mode alike (vLLM's LoRA does
    not reach the draft) — so the draft model holds the trainer's merged MTP weights (bf16 rounding)."""
    import sys
    from pathlib import Path

    from transformers import AutoTokenizer

    from glm5_mcore.config import glm5_744b, glm5_tiny
    from glm5_mcore.tiny import random_hf_state_dict, write_hf_checkpoint
    from rl.config import RLConfig
    from rl.rollout.base import Request, SamplingParams, sample_seed
    from rl.rollout.vllm_engine import VLLMRolloutEngine
    from rl.tasks.prompts import toy_prompts
    from rl.train.trainer import PolicyTrainer

    from tests.support.rl_setup import trainer_merged_mtp, vllm_draft_view

    real = glm5_744b()
    cfg = dataclasses.replace(glm5_tiny(mtp=True), kv_lora_rank=real.kv_lora_rank,
                              qk_rope_head_dim=real.qk_rope_head_dim, qk_nope_head_dim=real.qk_nope_head_dim,
                              v_head_dim=real.v_head_dim, q_lora_rank=256, index_head_dim=real.index_head_dim,
                              torch_dtype="bfloat16")
    sd = {k: v.to(torch.bfloat16) for k, v in random_hf_state_dict(cfg, seed=0).items()}
    d = str(write_hf_checkpoint(cfg, sd, tmp_path / "tiny_mtp576"))
    rl = RLConfig.from_dict(gpu_rl_dict(d, actor={"mtp_loss_scale": 0.3}))
    trainer = PolicyTrainer(rl)
    perturb(trainer, scale=0.2)  # the MTP layer's adapter included
    engine = VLLMRolloutEngine(d, merge=merge, dtype="bfloat16", gpu_memory_utilization=0.3, mtp_draft_tokens=1)
    try:
        engine.load_adapter(trainer.export_adapter(1))
        want = trainer_merged_mtp(trainer)
        draft = {k: torch.from_numpy(v) for k, v in engine.draft_weights().items()}
        for h, w in want.items():
            got = vllm_draft_view(h, draft, trainer.glm5.q_lora_rank)
            assert float((got - w.to(torch.bfloat16).float()).abs().max()) <= 1e-2 * float(w.abs().max()), h
        tok = AutoTokenizer.from_pretrained(d)
        prompts = toy_prompts(tok, 4, 0)
        reqs = [Request((p.index, k), p.ids, sample_seed(0, 0, p.index, k)) for p in prompts for k in range(2)]
        res = engine.generate(reqs, SamplingParams(1.0, 1.0, 8, ()))
        assert all(len(r.response_ids) == 8 == len(r.logprobs) for r in res)
        assert engine.spec_decode_counts()["draft_tokens"] > 0
    finally:
        engine.close()

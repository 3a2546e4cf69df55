"""vLLM rollout engine on the tiny GLM-5 (GPU only; skipped without CUDA/vLLM)."""

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm (GPU extra)"),
]


@pytest.mark.parametrize("merge", [False, True])
def test_vllm_engine_samples_with_logprobs_close_to_trainer(tiny_dir, merge):
    from transformers import AutoTokenizer

    from rl.config import RLConfig
    from rl.driver import fill_log_probs, make_batch
    from rl.rollout.base import Request, SamplingParams, sample_seed
    from rl.rollout.vllm_engine import VLLMRolloutEngine
    from rl.tasks import toy_prompts
    from rl.trainer import PolicyTrainer

    cfg = RLConfig.from_dict({"model": {"hf_dir": tiny_dir}, "wandb": {"mode": "disabled"}})
    trainer = PolicyTrainer(cfg)
    engine = VLLMRolloutEngine(tiny_dir, merge=merge, dtype="float32", gpu_memory_utilization=0.3)
    engine.load_adapter(trainer.export_adapter(1))
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    prompts = toy_prompts(tok, 4, 0)
    reqs = [Request((p.index, k), p.ids, sample_seed(0, 0, p.index, k)) for p in prompts for k in range(2)]
    res = engine.generate(reqs, SamplingParams(1.0, 1.0, 8, ()))
    assert all(len(r.response_ids) == 8 == len(r.logprobs) for r in res)
    batch = make_batch(prompts, res, 2)
    fill_log_probs(batch, [trainer.compute_log_probs(batch)])
    diff = (batch.old_log_probs - batch.rollout_log_probs)[batch.response_mask.bool()].abs()
    assert float(diff.mean()) < 1e-2, float(diff.mean())

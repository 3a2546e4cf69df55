"""Transformer Engine spec vs local spec on the same weights (GPU only; skipped without CUDA/TE).

TF32: PyTorch's fp32 matmuls (the local spec) run with TF32 off here, but Transformer Engine's fp32
GEMMs use TF32 tensor cores (10-bit mantissa, relative error ~2⁻¹¹ per product) whatever PyTorch's
flags say, so the two agree to TF32 rounding, not to fp32's: the bound is relative to the logits'
scale (measured expectation ~1e-3 on the tiny init, per the GPU-path review)."""

import importlib.util

import pytest
import torch

from glm5_mcore.config import GLM5Config

from glm5_mcore.mcore_settings import ParallelConfig
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                       reason="needs transformer-engine (the gpu extra)"),
]

TF32_RTOL = 4e-3
"""max |TE - local| / max |logit|: TF32 products (2⁻¹¹) summed over the tiny model's layers."""


def test_te_spec_matches_local_spec(tiny_dir, monkeypatch):
    """The TE spec (its routed experts ``TEGroupedMLP``, loaded through the name table) against the local spec."""
    from glm5_mcore.device import training_device
    from glm5_mcore.model.build import build_model, forward_logits
    from glm5_mcore.model.parallel import init_parallel
    from glm5_mcore.checkpoint.hf_load import load_hf_weights
    from glm5_mcore.parity import load_input_ids

    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    init_parallel(ParallelConfig())
    glm5 = GLM5Config.from_hf_dir(tiny_dir)
    ids = load_input_ids(None, glm5.vocab_size, 2, 32, seed=3).to(training_device())
    outs = {}
    for backend in ("local", "te"):
        m = build_model(glm5, ParallelConfig(), backend=backend)
        assert all(p.is_cuda for p in m.parameters()), backend  # build_model puts it on the device
        experts = type(m.decoder.layers[1].mlp.experts).__name__  # TE: grouped GEMM by default (model.moe_grouped_gemm)
        assert experts == ("TEGroupedMLP" if backend == "te" else "SequentialMLP"), (backend, experts)
        load_hf_weights(m, tiny_dir, glm5)
        m.eval()
        with torch.no_grad():
            outs[backend] = forward_logits(m, ids).float()
    diff = float((outs["te"] - outs["local"]).abs().max())
    scale = float(outs["local"].abs().max())
    print(f"te vs local max_abs {diff:.3g}, relative to max |logit| {diff / scale:.3g} (TF32 bound {TF32_RTOL})")
    assert diff <= TF32_RTOL * scale

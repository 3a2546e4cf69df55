"""Transformer Engine spec vs local spec on the same weights (GPU only; skipped without CUDA/TE)."""

import importlib.util

import pytest
import torch

from glm5_mcore.config import GLM5Config, ParallelConfig

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                       reason="needs transformer-engine (the gpu extra)"),
]


def test_te_spec_matches_local_spec(tiny_dir):
    from glm5_mcore.model import build_model, forward_logits, init_parallel, load_hf_weights
    from glm5_mcore.parity import load_input_ids

    init_parallel(ParallelConfig())
    glm5 = GLM5Config.from_hf_dir(tiny_dir)
    ids = load_input_ids(None, glm5.vocab_size, 2, 32, seed=3).cuda()
    outs = {}
    for backend in ("local", "te"):
        m = build_model(glm5, ParallelConfig(), backend=backend)
        load_hf_weights(m, tiny_dir, glm5)
        m = m.cuda().eval()
        with torch.no_grad():
            outs[backend] = forward_logits(m, ids).float()
    diff = (outs["te"] - outs["local"]).abs().max()
    print("te vs local max_abs", float(diff))
    assert diff <= 1e-4

"""Measures the activation peak of a real forward+backward of GLM-5 at scaled-down widths on CPU
(torch's ``MemTracker``: ACT + TEMP bytes at the peak) next to the planner's formula
(``glm5_mcore.plan.activations``), one JSON line per shape. Run by tests/plan/test_plan.py."""

import json
import sys

import torch

from glm5_mcore import kernels
from glm5_mcore.config import GLM5Config
from glm5_mcore.mcore_settings import ParallelConfig
from glm5_mcore.model.build import build_model, packed_seq_params_from_lengths
from glm5_mcore.model.parallel import init_parallel
from glm5_mcore.plan.activations import stage_activations
from glm5_mcore.plan.layout import Layout


def scaled(hidden: int, experts: int) -> GLM5Config:
    """GLM-5's shape ratios at a CPU-sized width: 1 dense + 3 MoE layers, every layer with an indexer."""
    return GLM5Config(vocab_size=4096, hidden_size=hidden, intermediate_size=2 * hidden,
                      moe_intermediate_size=hidden // 4, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=8, n_routed_experts=experts, num_experts_per_tok=4, kv_lora_rank=128,
                      q_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, index_topk=64,
                      index_head_dim=64, index_n_heads=8, first_k_dense_replace=1, max_position_embeddings=4096,
                      rope_theta=1e6, eos_token_id=1, bos_token_id=0, pad_token_id=2, torch_dtype="float32")


def measure(m: GLM5Config, tokens: int) -> dict:
    from torch.distributed._tools.mem_tracker import MemTracker

    torch.manual_seed(0)
    init_parallel(ParallelConfig())
    model = build_model(m, ParallelConfig(), mtp_num_layers=None, calculate_per_token_loss=True)
    ids = torch.randint(0, m.vocab_size, (1, tokens))
    pos = torch.arange(tokens)[None]
    psp = packed_seq_params_from_lengths([tokens])
    tracker = MemTracker()
    tracker.track_external(model)
    with tracker, kernels.disabled():  # the PyTorch (device) path, the one ``fused_dsa=False`` plans
        model(ids, pos, None, labels=ids, packed_seq_params=psp).sum().backward()
    peak = {str(k).split(".")[-1]: v for k, v in tracker.get_tracker_snapshot("peak")[torch.device("cpu")].items()}
    est = stage_activations(m, Layout(1), 0, tokens, bf16=False, recompute=False, mtp=False, microbatches=1,
                            fused_dsa=False)
    measured = peak["ACT"] + peak["TEMP"]
    return {"hidden": m.hidden_size, "experts": m.n_routed_experts, "tokens": tokens, "measured": measured,
            "formula": est.peak, "ratio": est.peak / measured}


if __name__ == "__main__":
    for spec in sys.argv[1:] or ["512,16,1024", "768,32,1536"]:
        h, e, t = map(int, spec.split(","))
        print(json.dumps(measure(scaled(h, e), t)), flush=True)

"""Builds sampled ranks of real GLM-5 744B layouts with torch.distributed's fake backend on the meta
device and prints, per rank, the built model's bytes next to the planner's (one JSON line each).
Run by tests/plan/test_plan.py in its own process (the fake process group replaces any other)."""

import json
import sys

from glm5_mcore.checkpoint.hf_io import FP8_BLOCK
from glm5_mcore.config import glm5_744b
from glm5_mcore.lora.config import DEFAULT_TARGETS
from glm5_mcore.model.fp8_linear import apply_fp8_base
from glm5_mcore.plan import fake_rank
from glm5_mcore.plan.layout import Layout
from glm5_mcore.plan.memory import state_bytes
from glm5_mcore.plan.params import lora_tensors, stage_tensors

# (name, layout, ranks, mtp, lora rank or None[, also with the frozen FP8 base]): the FP8 row of a case is the
# same built rank with its frozen base swapped for BlockFP8Weights in place (``{name}_fp8``), no second build
CASES = {
    "rl_old_tp8_ep8": (Layout(64, tp=8, ep=8), [0], False, 16),
    "ep64_full_ft": (Layout(64, tp=8, ep=64), [63], True, None),
    "pp2_ep64_lora": (Layout(128, tp=8, ep=64, pp=2), [0, 127], True, 16, True),  # last stage: MTP in FP8
    "pp13_ep16_full_ft": (Layout(208, tp=1, ep=16, pp=13), [96], True, None),
    # a padded vocabulary: 154880 at tp 8 rounded up to a multiple of 128 x 8 (155648 rows, 19456 per rank)
    "etp8_ep8_full_ft": (Layout(64, tp=8, ep=8, etp=8, make_vocab_size_divisible_by=128), [5], True, None),
    "shipped_rl": (Layout(64, tp=8, ep=64), [37], False, 16, True),
    "shipped_sft": (Layout(64, tp=8, ep=64), [63], True, 16),
}


def measure(name: str, model, L: Layout, rank: int, mtp: bool, lora, fp8: bool, bufs: dict) -> dict:
    """One JSON row: the built rank's bytes next to the planner's for the same rank (``fp8``: frozen FP8 base)."""
    m = glm5_744b()
    stage = rank // (L.world // L.pp)
    base = stage_tensors(m, L, stage, mtp)
    lt = lora_tensors(base, L, lora[0], lora[1]) if lora else []
    sb = state_bytes(base, lt, bf16=True, full_ft=lora is None, freeze_indexer=True, dp_cp=L.dp_cp,
                     expert_dp=L.expert_dp, base_fp8=fp8)
    return {"case": name, "rank": rank, "stage": stage, "built": fake_rank.tensor_bytes(model), **bufs,
            "base_fp8": fp8,
            "plan": {"params": sb.params, "param_bytes": sb.weights, "expert_params": sb.expert_params,
                     "trainable": sb.trainable, "buffer_bytes": sb.buffers, "grads": sb.grads,
                     "main_params": sb.main_params, "optimizer": sb.optimizer,
                     "main_params_dist": sb.main_params_dist, "optimizer_dist": sb.optimizer_dist}}


def main(names: list[str]) -> None:
    m = glm5_744b()
    for name in names:
        L, ranks, mtp, r, *fp8 = CASES[name]
        for rank in ranks:
            lora = (DEFAULT_TARGETS, r) if r else None
            model = fake_rank.build_rank(m, L, rank, mtp=mtp, lora=lora)
            # DDP's buffers hold the trainable (LoRA) parameters only: the same with the base in FP8
            bufs = {f"buffers_dist{int(d)}": fake_rank.grad_buffers(model, d) for d in (False, True)}
            print(json.dumps(measure(name, model, L, rank, mtp, lora, False, bufs)), flush=True)
            if fp8 and fp8[0]:
                apply_fp8_base(model, m.num_hidden_layers, FP8_BLOCK)
                print(json.dumps(measure(f"{name}_fp8", model, L, rank, mtp, lora, True, bufs)), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(CASES))

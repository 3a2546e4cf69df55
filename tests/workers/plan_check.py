"""Builds sampled ranks of real GLM-5 744B layouts with torch.distributed's fake backend on the meta
device and prints, per rank, the built model's bytes next to the planner's (one JSON line each).
Run by tests/plan/test_plan.py in its own process (the fake process group replaces any other)."""

import json
import sys

from glm5_mcore.config import glm5_744b
from glm5_mcore.lora.config import DEFAULT_TARGETS
from glm5_mcore.plan import fake_rank
from glm5_mcore.plan.layout import Layout
from glm5_mcore.plan.memory import state_bytes
from glm5_mcore.plan.params import lora_tensors, stage_tensors

# (name, layout, ranks, mtp, lora rank or None[, frozen FP8 base])
CASES = {
    "rl_old_tp8_ep8": (Layout(64, tp=8, ep=8), [0], False, 16),
    "ep64_full_ft": (Layout(64, tp=8, ep=64), [63], True, None),
    "pp2_ep64_lora": (Layout(128, tp=8, ep=64, pp=2), [0, 127], True, 16),
    "pp13_ep16_full_ft": (Layout(208, tp=1, ep=16, pp=13), [96], True, None),
    "etp8_ep8_full_ft": (Layout(64, tp=8, ep=8, etp=8), [5], True, None),
    "shipped_rl": (Layout(64, tp=8, ep=64), [37], False, 16),
    "shipped_sft": (Layout(64, tp=8, ep=64), [63], True, 16),
    # configs/rl/glm5_744b_h100_fp8.yaml: the frozen base in the release's FP8 (BlockFP8Weight), 16 GPUs
    "fp8_rl_h100_16": (Layout(16, tp=8, ep=16, cp=2), [13], False, 16, True),
    "fp8_pp2_mtp": (Layout(32, tp=8, ep=16, pp=2), [31], True, 16, True),
}


def main(names: list[str]) -> None:
    m = glm5_744b()
    for name in names:
        L, ranks, mtp, r, *fp8 = CASES[name]
        fp8 = bool(fp8 and fp8[0])
        for rank in ranks:
            lora = (DEFAULT_TARGETS, r) if r else None
            model = fake_rank.build_rank(m, L, rank, mtp=mtp, lora=lora, base_fp8=fp8)
            built = fake_rank.tensor_bytes(model)
            stage = rank // (L.world // L.pp)
            base = stage_tensors(m, L, stage, mtp)
            lt = lora_tensors(base, L, lora[0], lora[1]) if lora else []
            res = {"case": name, "rank": rank, "stage": stage, "built": built}
            for dist_opt in (False, True):
                bufs = fake_rank.grad_buffers(model, dist_opt)
                res[f"buffers_dist{int(dist_opt)}"] = bufs
            sb = state_bytes(base, lt, bf16=True, full_ft=lora is None, freeze_indexer=True, dp_cp=L.dp_cp,
                             expert_dp=L.expert_dp, base_fp8=fp8)
            res["base_fp8"] = fp8
            res["plan"] = {"params": sb.params, "param_bytes": sb.weights, "expert_params": sb.expert_params,
                           "trainable": sb.trainable, "buffer_bytes": sb.buffers, "grads": sb.grads,
                           "main_params": sb.main_params, "optimizer": sb.optimizer,
                           "main_params_dist": sb.main_params_dist, "optimizer_dist": sb.optimizer_dist}
            print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or list(CASES))

"""Run under torchrun (or alone): 3 LoRA training steps on the tiny checkpoint at the given TP/EP;
rank 0 writes the losses (JSON). Every rank sees the same batch, so any layout must give the
single-rank losses."""

import json
import sys

import torch
import torch.distributed as dist

from glm5_mcore.config import ParallelConfig
from glm5_mcore.lora.config import EXPERTS, MLA, MLP, LoRAConfig
from glm5_mcore.lora.apply import apply_lora
from glm5_mcore.parity import load_input_ids

from tests.support.helpers import hf_model, megatron_steps

SEQ = 32
# SGD maps equal gradients to equal updates; Adam turns fp32 reduction-order noise in near-zero
# gradients into full-size steps, so layouts drift apart for numerical, not semantic, reasons.
OPT, LR = (sys.argv[5], float(sys.argv[6])) if len(sys.argv) > 6 else ("sgd", 0.1)


def main(hf_dir: str, tp: int, ep: int, out: str) -> None:
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    torch.set_num_threads(1)
    m, glm5 = hf_model(hf_dir, ParallelConfig(tp=tp, ep=ep))
    apply_lora(m, LoRAConfig(rank=4, alpha=8, targets=MLA + MLP + EXPERTS, init="random"))
    m.train()
    m.config.finalize_model_grads_func = finalize_model_grads  # DP/EP grad sync + SP/TP all-reduces
    m = DistributedDataParallel(m.config, DistributedDataParallelConfig(), m)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer=OPT, lr=LR, clip_grad=1.0), [m])
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    adapters = {id(p) for n, p in m.named_parameters() if ".lora." in n}
    assert in_opt == adapters  # only adapters get optimizer state: no base weight, no (frozen) indexer
    ids = load_input_ids(None, glm5.vocab_size, 2, SEQ + 1, seed=7)
    losses = megatron_steps(m, opt, ids, 3, loss_after=True)
    from glm5_mcore.lora.state import save_adapter

    save_adapter(m.module, "default", out + ".adapter")  # gathered over TP / EP into full tensors
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(losses, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])

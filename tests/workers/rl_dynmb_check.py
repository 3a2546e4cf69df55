"""Run under torchrun (2 ranks, gloo, DP 2): for each case ``tests/rl/test_micro_batches.py`` wrote (an RL
config, a batch, an adapter, token budgets), ``PolicyTrainer.update`` on that batch once per budget, each
from that adapter; rank 0 writes, per case, each budget's metrics and every rank's micro-batch count to OUT.

Usage: rl_dynmb_check.py CASES.pt OUT.pt
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def load_adapter(trainer, adapter: dict) -> None:
    """Full (A, B) per adapted module into the policy adapter (each rank keeps its shard)."""
    from glm5_mcore.lora.apply import lora_layers

    with torch.no_grad():
        for _, _, lora in lora_layers(trainer.model):
            lora.load_full_("default", *adapter[lora.module_name])


def updates(trainer, case: dict) -> dict:
    """{budget: (update metrics, [micro-batch count of each rank])} from ``case["adapter"]`` each time."""
    batch, out = case["batch"], {}
    for budget in case["budgets"]:
        load_adapter(trainer, case["adapter"])
        trainer.cfg.actor.micro_batch_tokens = budget
        count = len(trainer._micro_batches(batch, list(range(batch.size))))
        counts = [count]
        if dist.is_initialized() and dist.get_world_size() > 1:
            counts = [None] * dist.get_world_size()
            dist.all_gather_object(counts, count)
        out[budget] = (trainer.update(batch, step=0), counts)
    return out


def main(cases_path: str, out_path: str) -> None:
    from rl.config import RLConfig
    from rl.train.trainer import PolicyTrainer
    from tests.support.helpers import save_on_rank0_and_finish

    torch.set_num_threads(1)
    out = [updates(PolicyTrainer(RLConfig.from_dict(case["cfg"])), case)
           for case in torch.load(cases_path, weights_only=False)]
    save_on_rank0_and_finish(out, out_path)


if __name__ == "__main__":
    main(*sys.argv[1:3])

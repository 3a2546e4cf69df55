"""Run under torchrun (2 ranks, gloo): the RL trainer with the MTP loss on, at TP 2 and then at DP 2 × EP 2,
on the batch and adapters ``test_rl_mtp`` wrote (``case.pt``: prompts, responses, scores and the policy
adapter as full tensors per module) — rank 0 writes each layout's ``mtp/loss``, ``rollout/mtp_accept`` and
old log-probs to ``out``. Shared with the single-rank reference: ``mtp_cfg``, ``load_case``, ``measure``."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def mtp_cfg(hf_dir: str, **trainer):
    """Every response row its own micro-batch (``micro_batch_tokens=17``: the case's samples have 11..17
    tokens, so no two fit one), one mini-batch (``mtp/loss`` is per token: the same under any split,
    ``tests/rl/test_micro_batches.py``)."""
    from rl.config import RLConfig

    return RLConfig.from_dict({"model": {"hf_dir": hf_dir}, "wandb": {"mode": "disabled"},
                               "rollout": {"n": 2, "temperature": 0.8},
                               "actor": {"mtp_loss_scale": 0.3, "ppo_mini_batch_size": 4, "micro_batch_tokens": 17},
                               "trainer": trainer})


def load_case(trainer, case: dict):
    """The case's adapter into ``trainer`` (each rank keeps its shard) and its batch."""
    from glm5_mcore.lora.apply import lora_layers
    from rl.train.batch import RolloutBatch

    for _, _, lora in lora_layers(trainer.model):
        a, b = case["adapter"][lora.module_name]
        lora.load_full_("default", a, b)
    p, r = case["prompts"], case["responses"]
    batch = RolloutBatch.build(p, r, [[-1.0] * len(x) for x in r], [i // 2 for i in range(len(r))])
    batch.scores = case["scores"].clone()
    return batch


def measure(trainer, cfg, batch) -> dict:
    """One RL step's MTP figures: old log-probs [B, R], then the update's ``mtp/loss`` and
    ``rollout/mtp_accept`` (None on ranks that do not report)."""
    from rl.train import algos
    from rl.train.batch import fill_log_probs

    out = trainer.compute_log_probs(batch)
    outs = [out]
    if dist.get_world_size() > 1:
        outs = [None] * dist.get_world_size()
        dist.all_gather_object(outs, out)
    fill_log_probs(batch, [o for o in outs if o is not None])
    batch.rollout_log_probs = batch.old_log_probs - 0.01
    algos.rollout_correction(cfg, batch)
    algos.compute_advantages(cfg, batch, 0.0)
    m = trainer.update(batch, step=0)
    if m is None:
        return None
    return {"mtp_loss": torch.tensor(m["mtp/loss"]), "mtp_accept": torch.tensor(m["rollout/mtp_accept"]),
            "old_log_probs": batch.old_log_probs.clone()}


def main(hf_dir: str, case_path: str, out: str) -> None:
    torch.set_num_threads(1)
    from rl.train.trainer import PolicyTrainer
    from tests.support.helpers import save_on_rank0_and_finish

    case = torch.load(case_path)
    res = {}
    for name, layout in (("tp2", {"world_size": 2, "tp": 2}), ("dp2ep2", {"world_size": 2, "ep": 2})):
        cfg = mtp_cfg(hf_dir, **layout)
        trainer = PolicyTrainer(cfg)  # torchrun's environment: one group of 2 ranks
        m = measure(trainer, cfg, load_case(trainer, case))
        if m is not None:
            res[name] = m
    save_on_rank0_and_finish(res, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])

"""Run under torchrun (2 ranks, gloo) on the stand-in device (``glm5_mcore/probes/fake_device.py``): one SFT step
at EP 2 × DP 2 (loss totals, micro-batch equalisation, validation), the RL trainer at DP 2 (log-probs,
update: micro-batch equalisation, metric reduction, the finite check) and parity at CP 2 and TP 2
(gathers), with every collective's tensors required on the training device. Prints one JSON line:
the violations (collective, caller, tensor) and how many collectives were checked."""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from glm5_mcore.probes.fake_device import assert_collectives_on, fake_device  # noqa: E402


def sft(hf_dir: str, data: str, out: str) -> None:
    from recipes.sft import SFTConfig, run

    run(SFTConfig.from_dict({
        "model": {"hf_dir": hf_dir}, "parallel": {"ep": 2},
        "data": {"train": data, "valid": data, "micro_batch_tokens": 64, "global_batch_tokens": 256,
                 "max_tokens": 64},
        "lora": {"rank": 2}, "optim": {"lr": 1e-3},
        "train": {"steps": 1, "eval_every": 1, "out": out, "progress": False}, "wandb": {"mode": "disabled"}}))


def rl(hf_dir: str) -> None:
    from rl.train import algos
    from rl.train.batch import RolloutBatch
    from rl.config import RLConfig
    from rl.train.batch import fill_log_probs
    from rl.train.trainer import PolicyTrainer

    cfg = RLConfig.from_dict({"model": {"hf_dir": hf_dir}, "wandb": {"mode": "disabled"},
                              "algorithm": {"adv_estimator": "gae"}, "rollout": {"n": 2},
                              "actor": {"ppo_mini_batch_size": 2}})
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 90, (6 + 5 * (i // 2),), generator=g).tolist() for i in range(4)]
    responses = [torch.randint(3, 90, (3 + i,), generator=g).tolist() for i in range(4)]
    batch = RolloutBatch.build(prompts, responses, [[-1.0] * len(r) for r in responses], [0, 0, 1, 1])
    batch.scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
    t = PolicyTrainer(cfg, rank=dist.get_rank(), world=dist.get_world_size())
    outs = [None] * dist.get_world_size()
    dist.all_gather_object(outs, t.compute_log_probs(batch))
    fill_log_probs(batch, [o for o in outs if o is not None])
    batch.rollout_log_probs = batch.old_log_probs - 0.01
    algos.rollout_correction(cfg, batch)
    algos.compute_advantages(cfg, batch, 0.0)
    m = t.update(batch, step=0)
    assert m is None or m["actor/updates_skipped"] == 0.0, m


def parity(hf_dir: str) -> None:
    from glm5_mcore.config import GLM5Config
    from glm5_mcore.mcore_settings import ParallelConfig
    from glm5_mcore.parity import load_input_ids, megatron_forward, model_source

    glm5 = GLM5Config.from_hf_dir(hf_dir)
    ids = load_input_ids(None, glm5.vocab_size, 1, 16, seed=5)
    for p in (ParallelConfig(cp=2), ParallelConfig(tp=2)):
        megatron_forward(model_source(hf_dir), ids, p, torch.float32)


def main(hf_dir: str, data: str, out: str) -> None:
    torch.set_num_threads(1)
    from glm5_mcore import kernels
    from glm5_mcore.mcore_settings import ParallelConfig
    from glm5_mcore.model.parallel import init_parallel

    init_parallel(ParallelConfig())
    seen, bad = [], []
    with kernels.disabled(), fake_device() as dev, assert_collectives_on(dev, seen, bad):
        for part in (lambda: sft(hf_dir, data, out), lambda: rl(hf_dir), lambda: parity(hf_dir)):
            try:
                part()
            except Exception as e:  # a crash is a finding too; keep going to list the rest
                bad.append(f"crash: {type(e).__name__}: {str(e)[:300]}")
    if dist.get_rank() == 0:
        print(json.dumps({"violations": sorted(set(bad)), "checked": len(seen),
                          "callers": sorted({w for _, w in seen})}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:4])

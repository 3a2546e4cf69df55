"""The RL trainer on a saved ``RolloutBatch``: old / reference log-probs and critic values with router
replay off and on, then two PPO updates with replay on and the log-probs and values after them; ``tests/rl/test_cp.py`` runs ``run`` in-process
at CP 1 and this script under ``torchrun --nproc_per_node 2`` at ``trainer.cp=2``, and compares.

Usage: rl_cp_check.py CONFIG.json BATCH.pt OUT.pt
"""

import json
import sys

import torch


def build(cfg):
    from rl.train.trainer import PolicyTrainer
    from tests.support.rl_setup import perturb

    trainer = PolicyTrainer(cfg)
    perturb(trainer)  # a policy adapter that is not the identity
    return trainer


def run(trainer, cfg, batch) -> dict:
    """What CP must not change (on the reporting rank; None elsewhere)."""
    from megatron.core.transformer.moe.router import TopKRouter

    from rl.train import algos
    from rl.train.batch import fill_log_probs
    from rl.train.routing import index_metrics, router_metrics

    routers = [m for n, m in trainer.model.named_modules() if isinstance(m, TopKRouter) and not n.startswith("mtp.")]
    maps = []
    hooks = [r.register_forward_hook(lambda _m, _a, out: maps.append(out[1])) for r in routers]
    out = {}
    try:
        for replay in (False, True):
            maps.clear()
            trainer.routing.replay = replay
            res = trainer.compute_log_probs(batch)
            if trainer.reports:
                out[replay] = {k: res[k] for k in ("old_log_probs", "ref_log_probs", "values")}
                out[replay].update(router_metrics([res]), **index_metrics([res]))
    finally:
        for h in hooks:
            h.remove()
    # replayed routing maps (old, ref and value forwards of each micro-batch) == the engine's experts
    # on every token this rank holds that has engine routes
    mbs = trainer._micro_batches(batch, list(range(batch.size)))
    per_mb = len(maps) // len(mbs)
    checked = mismatched = 0
    for f in range(0, len(maps), len(routers)):
        mb = mbs[f // per_mb]
        routes, v = trainer.routing.tp_slice(mb.routes), trainer.routing.tp_slice(mb.routes_valid)  # this TP rank's
        for j, rmap in enumerate(maps[f: f + len(routers)]):
            eng = torch.zeros_like(rmap).scatter_(1, routes[:, j], True)
            checked += int(v.sum())
            mismatched += int((rmap[v] != eng[v]).any(-1).sum())
    import torch.distributed as dist

    if dist.is_initialized() and dist.get_world_size() > 1:  # every rank's replayed tokens
        counts = torch.tensor([checked, mismatched], dtype=torch.long)
        dist.all_reduce(counts)
        checked, mismatched = counts.tolist()
    longest = max((len(batch.responses[i]), mb.num_tokens) for mb in mbs for i in mb.rows)
    if trainer.reports:
        fill_log_probs(batch, [res])
    batch = _broadcast(batch)
    algos.rollout_correction(cfg, batch)
    algos.compute_advantages(cfg, batch, 0.0)
    metrics = [trainer.update(batch, step) for step in range(2)]
    trainer.routing.replay = False
    after = trainer.compute_log_probs(batch)  # the trained policy and critic (values no longer 0)
    if not trainer.reports:
        return None
    params = {n: p.detach().clone() for n, p in trainer.ddp.named_parameters() if p.requires_grad}
    after = {k: after[k] for k in ("old_log_probs", "ref_log_probs", "values")}
    return {"off": out[False], "on": out[True], "after": after, "metrics": metrics, "params": params,
            "replay": {"checked": checked, "mismatched": mismatched},
            "longest_response_vs_local_tokens": longest}


def _broadcast(batch):
    """Rank 0's filled batch on every rank (the driver hands every trainer rank the same batch)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return batch
    obj = [batch]
    dist.broadcast_object_list(obj, src=0)
    return obj[0]


def main(cfg_path: str, batch_path: str, out_path: str) -> None:
    from rl.config import RLConfig
    from tests.support.helpers import save_on_rank0_and_finish

    torch.set_num_threads(1)
    cfg = RLConfig.from_dict(json.loads(open(cfg_path).read()))
    batch = torch.load(batch_path, weights_only=False)
    trainer = build(cfg)
    save_on_rank0_and_finish(run(trainer, cfg, batch), out_path)


if __name__ == "__main__":
    main(*sys.argv[1:4])

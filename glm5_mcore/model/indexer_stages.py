"""The DSA indexer's training-stage switches over a whole model: the dense warm-up, the frozen
indexer, the recall probe, the check that a trainable indexer gets a loss, and the metrics they log.
The per-layer behaviour lives in ``glm5_mcore.model.dsa.GLM5SparseAttention``."""

from __future__ import annotations

import torch

from glm5_mcore.model.dsa import GLM5SparseAttention
from glm5_mcore.model.indexer_loss import indexer_trainable


def set_indexer_warmup(model: torch.nn.Module, coeff: float) -> int:
    """Indexer warm-up on (``coeff`` > 0) or off: in training forwards every full DSA layer attends
    densely and adds ``coeff`` × the KL indexer loss. Returns #layers."""
    n = 0
    for m in model.modules():
        if isinstance(m, GLM5SparseAttention) and m.computes_topk:
            m.warmup_coeff = float(coeff)
            n += 1
    return n


def indexer_metrics(model: torch.nn.Module, group=None) -> dict[str, float]:
    """``indexer/loss`` (mean KL per query row, before the coefficient) and ``indexer/recall`` (mean
    share of dense attention mass inside the top-k, on the sampled rows where K is a real choice)
    over every layer and row of the training forwards since the last call (warm-up or sparse stage),
    summed over the ranks of ``group`` (default: all; a collective every rank must call — TP copies
    count twice on both sides of each ratio). {} when no indexer loss ran."""
    import torch.distributed as dist

    tot = torch.zeros(4, dtype=torch.float64)
    for m in model.modules():
        if isinstance(m, GLM5SparseAttention):
            tot += torch.stack([torch.as_tensor(v).detach().to("cpu", torch.float64) for v in m.indexer_stats])
            m.indexer_stats = [0.0, 0, 0.0, 0]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        from glm5_mcore.device import training_device

        tot = tot.to(training_device())  # NCCL reduces device tensors only
        dist.all_reduce(tot, group=group)
        tot = tot.cpu()
    out = {}
    if tot[1] > 0:
        out["indexer/loss"] = float(tot[0] / tot[1])
    if tot[3] > 0:
        out["indexer/recall"] = float(tot[2] / tot[3])
    return out


def set_recall_probe(model: torch.nn.Module, on: bool = True) -> int:
    """Measure ``indexer/recall`` in every training forward of a full DSA layer, also where no indexer
    loss runs (a frozen indexer: shows how far the model's attention drifts from its top-k), at the
    cost of ``recall_rows`` dense attention rows per layer. Returns #layers."""
    n = 0
    for m in model.modules():
        if isinstance(m, GLM5SparseAttention) and m.computes_topk:
            m.probe_recall = bool(on)
            n += 1
    return n


def check_indexer_learns(model: torch.nn.Module, setting: str = "train.indexer_loss_coeff") -> None:
    """Refuse an indexer that takes gradients with no loss to give it any: the LM loss never reaches
    it (its top-k is not differentiable), so without the warm-up or sparse-stage loss it would be a
    silent no-op. Raises ValueError naming ``setting``."""
    for m in model.modules():
        if not (isinstance(m, GLM5SparseAttention) and indexer_trainable(m.indexer)):
            continue
        if m.warmup_coeff > 0 or (m.config.dsa_indexer_loss_coeff or 0.0) > 0:
            continue
        raise ValueError(f"{setting}: layer {m.layer_number}'s DSA indexer requires gradients but no indexer loss "
                         "reaches it (the LM loss does not); set the indexer loss coefficient > 0 or freeze "
                         "the indexer")


def set_indexer_frozen(model: torch.nn.Module, frozen: bool = True) -> int:
    """Freeze (or unfreeze) every DSA indexer: no grads, hence no optimizer state. Returns #params."""
    count = 0
    for m in model.modules():
        if isinstance(m, GLM5SparseAttention) and m.indexer is not None:
            for p in m.indexer.parameters():
                p.requires_grad_(not frozen)
                count += p.numel()
    return count

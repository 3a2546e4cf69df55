"""Bytes per rank: weights, gradients, fp32 main parameters, optimizer state.

Megatron-Core's rules, as ``glm5_mcore.training.loop.build_trainer`` sets them up:
- weights in the job's dtype (bf16 or fp32); router weight and MoE buffers always fp32; with a frozen FP8 base
  (``model.base_dtype=fp8``, LoRA) the linears the release stores in FP8 hold 1 byte per element + one fp32
  scale per 128×128 block (``TensorGroup.fp8_bytes``);
- gradients: DDP's contiguous buffer in each trainable parameter's dtype (``grad_reduce_in_fp32`` off);
- bf16: Megatron's mixed-precision optimizer keeps an fp32 main copy of each trainable bf16 parameter;
- Adam: two fp32 moments per trainable parameter;
- the distributed optimizer shards main copies and moments over the data-parallel group a parameter is
  reduced over (``dp × cp`` for dense parameters, the expert-data-parallel group for routed experts);
- an FP8 base on Transformer Engine holds its 1 byte per element outside backward; inside one module's backward
  TE makes that module's column-wise copy (``model.fp8_te``): ``te_dgrad_copy``, the largest such module (a
  layer's grouped routed experts, all local experts at once).
"""

from __future__ import annotations

from dataclasses import dataclass

from glm5_mcore.plan.params import TensorGroup

ADAM_STATE_BYTES = 8


@dataclass
class StateBytes:
    weights: int
    buffers: int
    params: int
    """Parameter count (adapters included)."""
    expert_params: int
    trainable: int
    grads: int
    main_params: int
    optimizer: int
    main_params_dist: int
    optimizer_dist: int
    grad_buffers: list
    """Per DDP buffer: (expert, dtype bytes, numel) as Megatron groups them (for the exactness test)."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def state_bytes(base: list[TensorGroup], lora: list[TensorGroup], *, bf16: bool, full_ft: bool,
                freeze_indexer: bool, dp_cp: int, expert_dp: int, base_fp8: bool = False) -> StateBytes:
    """Model and optimizer state of one rank. ``base`` from ``stage_tensors``; ``lora`` from
    ``lora_tensors`` (empty for full fine-tuning, where every base parameter but a frozen indexer trains);
    ``base_fp8``: the frozen base in FP8 (LoRA only)."""
    if base_fp8 and full_ft:
        raise ValueError("model.base_dtype=fp8: the frozen FP8 base is for LoRA (full fine-tuning trains the base)")
    pb = 2 if bf16 else 4
    weights = buffers = params = experts = 0
    bufs: dict[tuple, int] = {}
    for g in base + lora:
        nbytes = 4 if g.fp32 else pb
        if g.buffer:
            buffers += g.total * nbytes
            continue
        weights += g.fp8_bytes if (base_fp8 and g.fp8) else g.total * nbytes
        params += g.total
        experts += g.total if (g.expert and g in base) else 0
        is_lora = g.name.startswith("lora.")
        trains = is_lora or (full_ft and not (g.indexer and freeze_indexer))
        if trains:
            key = (g.expert, nbytes)
            bufs[key] = bufs.get(key, 0) + g.total
    trainable = sum(bufs.values())
    grads = sum(n * b for (_, b), n in bufs.items())
    half = sum(n for (_, b), n in bufs.items() if b == 2)
    main = 4 * half
    main_dist = opt_dist = 0
    for (expert, b), n in bufs.items():
        shard = _ceil_div(n, expert_dp if expert else dp_cp)
        main_dist += 4 * shard if b == 2 else 0
        opt_dist += ADAM_STATE_BYTES * shard
    return StateBytes(weights=weights, buffers=buffers, params=params, expert_params=experts, trainable=trainable,
                      grads=grads, main_params=main, optimizer=ADAM_STATE_BYTES * trainable,
                      main_params_dist=main_dist, optimizer_dist=opt_dist,
                      grad_buffers=sorted((e, b, n) for (e, b), n in bufs.items()))


def te_dgrad_copy(base: list[TensorGroup], local_experts: int) -> int:
    """Bytes of the column-wise copy TE makes inside one FP8 module's backward, for the largest module of ``base``
    (routed experts: one grouped linear holds the layer's ``local_experts``); freed after that backward."""
    per_module = [g.fp8_bytes // g.count * (local_experts if g.expert else 1) for g in base if g.fp8 and g.count]
    return max(per_module, default=0)

"""Training-loop pieces shared by the SFT recipe and the RL trainer.

- ``build_trainer``: Megatron-Core ``DistributedDataParallel`` + ``get_megatron_optimizer`` + the
  ``OptimizerParamScheduler`` over the model's trainable parameters (LoRA adapters, or all of it).
- ``synced_params``: every rank's full updated parameters for a block that reads them outside a forward (a
  checkpoint save, an evaluation, an adapter export) under ``overlap_param_gather``.
- ``forward_backward``: Megatron's own schedule (``get_forward_backward_func``) over a list of
  micro-batches with a caller's ``forward_step`` — gradient accumulation with DDP's no-sync and
  ``finalize_model_grads`` (DP all-reduce) exactly as Megatron training does.
- ``rng_state`` / ``set_rng_state``: Python / torch / NumPy / CUDA / Megatron-tracker RNG for bit-exact resume.
- ``WandbCfg`` / ``init_wandb``: the W&B run of a recipe (offline unless a project is given).
- ``MoELoad``: tokens routed to each expert (router hooks) -> the max/mean expert-load metrics.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from typing import Callable, Optional

import torch


@dataclass
class OptimCfg:
    """The optimizer and LR schedule (the SFT recipe's ``optim`` section)."""

    optimizer: str = "adam"
    lr: float = 1e-4
    min_lr: float = 0.0
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    clip_grad: float = 1.0
    warmup_steps: int = 0
    decay_style: str = "cosine"
    distributed: Optional[bool] = None
    """Megatron's distributed optimizer (states sharded over DP). None: on with CUDA and DP > 1; CPU runs
    keep a replicated optimizer unless this is true (it runs on gloo too)."""
    overlap_grad_reduce: bool = False
    """Megatron DDP's ``overlap_grad_reduce``: each gradient bucket is reduced (reduce-scattered with the
    distributed optimizer) as soon as the last micro-batch's backward fills it, overlapping the backward;
    the schedule's earlier micro-batches run under ``ddp.no_sync``."""
    overlap_param_gather: bool = False
    """Megatron DDP's ``overlap_param_gather`` (distributed optimizer only): the step updates each rank's
    shard and each bucket's parameter all-gather runs during the next forward (DDP's forward pre-hooks), not
    in the step. Checkpoint saves, evaluations and adapter exports sync the parameters first
    (``synced_params``), as Megatron-LM's training loop does."""


def check_optimizer(o: OptimCfg, dp: int, section: str) -> bool:
    """Whether Megatron's distributed optimizer is on at data-parallel size ``dp``; ``overlap_param_gather``
    without it (nothing to overlap) is a ValueError naming ``section``'s field."""
    dist_opt = o.distributed if o.distributed is not None else (torch.cuda.is_available() and dp > 1)
    if o.overlap_param_gather and not dist_opt:
        raise ValueError(f"{section}.overlap_param_gather: needs Megatron's distributed optimizer (the parameter "
                         f"all-gather it overlaps), which is off here: it is on with CUDA and DP > 1"
                         + (f", or with {section}.distributed=true" if section == "optim" else ""))
    return dist_opt


def build_trainer(model, o: OptimCfg, total_steps: int, bf16: bool = False, cpu_offload: bool = False):
    """(ddp, optimizer, scheduler) for ``model``'s parameters that require grad; the schedule spans
    ``total_steps``. Under bf16 the DDP gradient buffers and their reduction are fp32."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    model.config.finalize_model_grads_func = finalize_model_grads
    dist_opt = check_optimizer(o, ps.get_data_parallel_world_size(), "optim")
    bf16 = bf16 or bool(model.config.bf16)
    # Megatron-LM turns grad_reduce_in_fp32 on for bf16: gradients accumulate and are reduced in fp32
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=dist_opt, grad_reduce_in_fp32=bf16, overlap_grad_reduce=o.overlap_grad_reduce,
        overlap_param_gather=o.overlap_param_gather), model)
    if o.overlap_grad_reduce:  # as Megatron-LM's training.py: no reduce before the last micro-batch
        model.config.no_sync_func = ddp.no_sync
    opt = get_megatron_optimizer(OptimizerConfig(
        optimizer=o.optimizer, lr=o.lr, min_lr=o.min_lr, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
        adam_beta2=o.adam_beta2, clip_grad=o.clip_grad, bf16=bf16, optimizer_cpu_offload=cpu_offload,
        use_distributed_optimizer=dist_opt, overlap_param_gather=o.overlap_param_gather), [ddp])
    steps = max(1, total_steps)
    sched = OptimizerParamScheduler(opt, init_lr=0.0 if o.warmup_steps else o.lr, max_lr=o.lr, min_lr=o.min_lr,
                                    lr_warmup_steps=o.warmup_steps, lr_decay_steps=steps,
                                    lr_decay_style=o.decay_style, start_wd=o.weight_decay, end_wd=o.weight_decay,
                                    wd_incr_steps=steps, wd_incr_style="constant")
    return ddp, opt, sched


@contextlib.contextmanager
def synced_params(ddp, opt):
    """Inside the block every rank's model holds the full updated parameters. Under ``overlap_param_gather`` an
    optimizer step leaves the other ranks' shards of each parameter stale until the next forward gathers them,
    so a save, evaluation or export first forces the all-gather and keeps the forward pre-hooks off meanwhile;
    Megatron-LM does the same (core_v0.19.0 ``megatron/training/training.py``: ``force_param_sync`` before
    every checkpoint save, 3022-3046; ``disable_forward_pre_hook`` around evaluation, 4010-4011 / 4056-4057).
    Without the overlap it does nothing: the step has gathered them."""
    if not ddp.ddp_config.overlap_param_gather:
        yield
        return
    opt.prepare_model_params_for_param_sync()
    ddp.disable_forward_pre_hook(param_sync=True)
    try:
        yield
    finally:
        ddp.enable_forward_pre_hook()


def forward_backward(ddp, forward_step: Callable, batches: list, forward_only: bool, seq_length: int) -> list:
    """Megatron's schedule over ``batches`` (one per micro-batch); returns the loss functions' reports.
    ``seq_length``: the longest micro-batch's tokens before the CP split (Megatron divides it by CP and,
    under sequence parallelism, TP to size the pipeline's P2P buffers)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(batches), model=[ddp],
                                       num_microbatches=len(batches), seq_length=seq_length, micro_batch_size=1,
                                       forward_only=forward_only)


@dataclass
class WandbCfg:
    project: Optional[str] = None
    mode: Optional[str] = None
    """None: "offline" unless a project is given (then "online"); "disabled" turns W&B off."""
    name: Optional[str] = None


def init_wandb(cfg: WandbCfg, out: str, config: dict):
    """A W&B run logging into ``out/wandb`` (None when disabled)."""
    import os
    from pathlib import Path

    mode = cfg.mode or ("online" if cfg.project else "offline")
    if mode == "disabled":
        return None
    import wandb

    os.environ.setdefault("WANDB_SILENT", "true")
    Path(out).mkdir(parents=True, exist_ok=True)
    return wandb.init(project=cfg.project or "glm5-mcore", name=cfg.name, mode=mode, dir=out, config=config,
                      reinit="finish_previous")


def rng_state() -> dict:
    """Every RNG a step draws from: Python, torch (CPU), NumPy, the current CUDA device's generator, and
    Megatron's CUDA RNG tracker (``tensor_parallel.get_cuda_rng_tracker``: the model-parallel and expert
    streams dropout and recompute use)."""
    import numpy as np
    from megatron.core import tensor_parallel

    out = {"python": random.getstate(), "torch": torch.get_rng_state(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    tracker = tensor_parallel.get_cuda_rng_tracker()
    if tracker.is_initialized():
        out["megatron_cuda"] = {k: _copy_rng(v) for k, v in tracker.get_states().items()}
    return out


def set_rng_state(s: dict) -> None:
    """Restore ``rng_state()`` (a state saved before the CUDA entries existed restores what it has)."""
    import numpy as np
    from megatron.core import tensor_parallel

    random.setstate(s["python"])
    torch.set_rng_state(s["torch"])
    np.random.set_state(s["numpy"])
    if "cuda" in s and torch.cuda.is_available():
        torch.cuda.set_rng_state(s["cuda"])
    if "megatron_cuda" in s:
        tensor_parallel.get_cuda_rng_tracker().set_states({k: _copy_rng(v) for k, v in s["megatron_cuda"].items()})


def _copy_rng(state):
    """A copy of one tracker state: a ByteTensor, or a ``torch.Generator`` with cudagraph-safe RNG."""
    return state.clone() if torch.is_tensor(state) else state.clone_state()


class MoELoad:
    """Tokens routed to each expert per MoE layer (router forward hooks), for the load metrics.
    ``token_mask`` (bool [tokens the router sees], optional): count only those tokens (the RL trainer
    leaves out filler documents and context-parallel padding)."""

    def __init__(self, model):
        self.counts: dict[str, torch.Tensor] = {}
        self.token_mask: torch.Tensor | None = None
        for name, mod in model.named_modules():
            if name.endswith("mlp.router"):
                mod.register_forward_hook(self._hook(name))

    def _hook(self, name):
        def h(_mod, _inp, out):
            m = out[1].detach().float()  # routing map [tokens, experts]
            if self.token_mask is not None:  # a product, not a boolean index: no host sync in every MoE layer
                m = m * self.token_mask.to(device=m.device, dtype=m.dtype)[:, None]
            c = m.sum(0)
            self.counts[name] = self.counts.get(name, 0) + c
        return h

    def metrics(self) -> dict[str, float]:
        out = {}
        imb = []
        for name, c in self.counts.items():
            layer = name.split(".")[-3] if ".layers." in name else name
            mean = float(c.mean()) or 1.0
            imb.append(float(c.max()) / mean)
            out[f"moe/max_over_mean/layer_{layer}"] = imb[-1]
        if imb:
            out["moe/max_over_mean"] = max(imb)
        self.counts = {}
        return out

"""Megatron-Core distributed-checkpoint I/O of one iteration folder (``glm5_mcore.checkpoint.layout``):
the model's base weights (``model/``, loads at any TP/EP/PP), the optimizer's sharded state
(``optimizer/dist``, LoRA tensors marked TP-sharded), each rank's ``optimizer/rank_{r}.pt`` (scheduler,
RNG) and ``trainer_state.json``. Every load verifies the files it reads against the iteration's manifest."""

from __future__ import annotations

import copy
import json
import queue
import time
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core import parallel_state as ps
from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, nested_values
from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedBase, ShardedTensor
from megatron.core.dist_checkpointing.strategies import filesystem_async
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint
from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

from glm5_mcore import cpu_compat
from glm5_mcore.checkpoint import manifest
from glm5_mcore.checkpoint.checks import check_finite, short_error
from glm5_mcore.checkpoint.fp8_sharded import FP8Load, fp8_sharded_state_dict
from glm5_mcore.checkpoint.layout import iter_dir


def verify_once(path: str | Path) -> None:
    """``manifest.verify_under(path)`` shared by every rank: rank r hashes its share of the files
    (``manifest.share``: by size, balanced), all at once, and the verdicts are gathered so that every rank
    raises the same error (the first bad file). 1.5 TB over 64 ranks is ~23 GB each, not 1.5 TB on rank 0
    while the others wait out the process group's timeout (``glm5_mcore.device.dist_timeout``).
    Rank 0 prints what it checks and how fast."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        manifest.verify_under(path)
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    t0 = time.monotonic()
    verdict = None
    try:
        n, nbytes = manifest.verify_under(path, share=(rank, world), report=True)
    except ValueError as e:
        verdict, n, nbytes = str(e), 0, 0
    if rank == 0 and nbytes:
        dt = time.monotonic() - t0
        print(f"verified {path}: {n} files, {nbytes / 1e9:.1f} GB on rank 0 of {world} in {dt:.1f}s "
              f"({nbytes / 1e9 / max(dt, 1e-9):.2f} GB/s)", flush=True)
    verdicts = [None] * world
    dist.all_gather_object(verdicts, verdict)
    bad = next((v for v in verdicts if v is not None), None)
    if bad is not None:
        raise manifest.ChecksumError(bad)


def base_sharded_state_dict(model) -> dict:
    """``model.sharded_state_dict()`` without LoRA adapters (saved on their own, under adapters/)."""
    return {k: v for k, v in model.sharded_state_dict().items() if ".lora." not in k}


def save_sharded(sharded_state_dict: dict, path: str | Path, **kwargs) -> None:
    """``dist_checkpointing.save`` (every rank calls it), synchronous as every save here is, with its write
    results handed back through a thread queue. Megatron's synchronous torch_dist save is its async save run
    at once (``strategies/torch.py:725-729``), whose writer fetches ``get_write_results_queue()``
    (``filesystem_async.py:53-66``): a ``multiprocessing`` Manager queue, i.e. a spawned server process per
    rank that imports the main module again (seconds of CPU and a Python process's memory, at the first save of
    every process), though its only reader is this process (``retrieve_write_results``: ``get_nowait``).
    ``kwargs``: ``dist_checkpointing.save``'s (``content_metadata``)."""
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    dist_checkpointing.save(sharded_state_dict, str(path), **kwargs)


def save_model(model, path: str | Path) -> None:
    """Megatron-Core distributed save of ``model`` (every rank calls it) into the empty folder ``path``; a frozen
    FP8 base as its stored bytes and block scales (``fp8_sharded``)."""
    cpu_compat.apply()
    path = Path(path)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    save_sharded(fp8_sharded_state_dict(base_sharded_state_dict(model)), path)


@torch.no_grad()
def load_model(model, path: str | Path, allow_nonfinite: bool = False) -> None:
    """Load a Megatron-Core distributed checkpoint into ``model`` at this process's TP/EP/PP layout,
    its files verified against the iteration's manifest; a NaN/Inf weight is an error naming it.
    Megatron-LM / Bridge checkpoints: the non-tensor state their trainers save beside the weights
    (``checkpoint_version``, ``iteration``, ``args``, ``content_metadata``, ...) is not the model's and is
    left out; tensors stored in another dtype (a bf16 router) are cast to the parameter's. Weights stored in FP8
    (``fp8_sharded``) load as stored into a frozen FP8 base, dequantized into dense parameters; a dense
    checkpoint into an FP8 base is quantized once."""
    cpu_compat.apply()
    path = Path(path)
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"{path}: not a Megatron-Core distributed checkpoint (no metadata.json)")
    verify_once(path)
    fp8 = FP8Load(base_sharded_state_dict(model), path, model)
    try:
        state = dist_checkpointing.load(dict(fp8.sharded), str(path))
    except (Exception, CheckpointException) as e:
        raise ValueError(f"{path}: could not load the checkpoint ({short_error(e)})") from None
    state = {k: v for k, v in state.items() if k in fp8.sharded}
    state, written = fp8.finish(state, allow_nonfinite)
    if not allow_nonfinite:
        for k, v in state.items():
            if torch.is_tensor(v):
                check_finite(v, k, path)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state") and ".lora." not in k and k not in written]
    if missing or unexpected:
        raise ValueError(f"{path}: checkpoint does not fit the model (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")


OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
                      "chained_optim_avoid_prefix": True}
"""Megatron-LM's sharded-state metadata of the distributed optimizer: its buffers saved as they are
sharded over DP (fully parallel, no gather; reshardable over DP only, so a ``ChainedOptimizer``'s
keys carry its ``chained_N.`` prefix)."""

PLAIN_OPTIMIZER_METADATA = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
"""The plain (not distributed) optimizer's: its state is per parameter, keyed by the parameter's sharded key,
so it reshards over every layout; without a DP-only sharding type a ``ChainedOptimizer`` (dense + expert
optimizers, built when the experts' gradients reduce over another group than DP: EP > 1 or ETP != TP) adds no
``chained_N.`` prefix and its tensors have the keys a single optimizer's have."""


def sub_optimizers(opt) -> list:
    """The optimizers a ``ChainedOptimizer`` chains (``[opt]`` for one that is not chained)."""
    return list(getattr(opt, "chained_optimizers", [opt]))


def is_distributed(opt) -> bool:
    """Whether any of ``opt``'s optimizers is Megatron's distributed optimizer."""
    return any(isinstance(o, DistributedOptimizer) for o in sub_optimizers(opt))


def chained_parts(state: dict) -> list:
    """The per-optimizer parts of an optimizer (sharded) state dict: a ``ChainedOptimizer`` of several gives
    ``{0: part, 1: part, ...}``, one optimizer its own dict (keys ``optimizer``, ``state``, ...)."""
    if isinstance(state, dict) and state and all(isinstance(k, int) for k in state):
        return [state[k] for k in sorted(state)]
    return [state]


def _common_step(state: dict):
    """The shared Adam step Megatron saves as ``state.common_step`` (under ``optimizer`` for the mixed-precision
    optimizer) in any of ``state``'s parts; None before the first step."""
    for part in chained_parts(state):
        inner = part.get("optimizer", part)
        if isinstance(inner, dict) and "common_step" in inner.get("state", {}):
            return inner["state"]["common_step"]
    return None


def _adapters_tp_sharded(sd: dict) -> dict:
    """``sd`` with the TP-sharded LoRA tensors (``tensor_model_parallel`` set by ``lora._tag``) marked
    as sharded: a base linear's ``sharded_state_dict`` covers its ``lora`` child as replicated, so
    TP rank 0's shard alone would be saved. GLU fc1's B is [gate_shard; up_shard] on each rank, as
    Megatron's fc1 weight (``apply_swiglu_sharded_factory``). A routed expert's adapter (its prepended
    global-expert axis; ``SequentialMLP`` and ``lora.grouped`` alike) is sharded over the expert-TP group,
    one replica per expert-DP group, as the experts' own weights: the keys load at any ETP / EP."""
    out = {}
    for k, v in sd.items():
        p = getattr(v, "data", None) if isinstance(v, ShardedTensor) else None
        if ".lora." in k and p is not None and getattr(p, "tensor_model_parallel", False):
            prepend = tuple((i, v.global_offset[i], v.axis_fragmentations[i]) for i in range(v.prepend_axis_num))
            groups = dict(tp_group=ps.get_expert_tensor_parallel_group(),
                          dp_cp_group=ps.get_expert_data_parallel_group()) if prepend else {}
            sh = make_tp_sharded_tensor_for_checkpoint(p, v.key, tp_axis=p.partition_dim, prepend_offsets=prepend,
                                                       **groups)
            if prepend:
                sh.replica_id = (v.replica_id[0], 0, v.replica_id[2])
            v = apply_swiglu_sharded_factory(sh, prepend) if ".linear_fc1.lora.B." in v.key and \
                p.partition_dim == 0 else sh
        out[k] = v
    return out


def optimizer_sharded_state_dict(opt, model, is_loading: bool = False) -> dict:
    """Megatron-Core's sharded optimizer state of ``opt`` over ``model``'s parameters (the plain
    optimizer's per-parameter state, or the distributed optimizer's moments and fp32 main params)."""
    model_sd = _adapters_tp_sharded(model.sharded_state_dict())
    meta = OPTIMIZER_METADATA if is_distributed(opt) else PLAIN_OPTIMIZER_METADATA
    return opt.sharded_state_dict(model_sd, is_loading=is_loading, metadata=dict(meta))


def load_across_chaining(sharded: dict, saved_common: dict, path: Path) -> dict:
    """The state dict to give ``opt.load_state_dict`` when the checkpoint at ``path`` was saved by a
    differently chained optimizer (``saved_common``, its common state: one optimizer at EP 1 / ETP = TP, a dense
    and an expert one at EP > 1 or ETP != TP): ``dist_checkpointing.load`` builds its result on the saved
    common state, whose structure is then not this optimizer's. Each parameter's tensors (moments, fp32 main
    params) are loaded by their sharded keys into this optimizer's own structure (``sharded``, from
    ``optimizer_sharded_state_dict(..., is_loading=True)``) and every part gets the saved shared step; the param
    groups' hyperparameters are this run's (the scheduler, restored from the rank files, sets lr and wd)."""
    step = _common_step(saved_common)
    if step is None:
        raise ValueError(f"{path}: the optimizer state has no step (common_step) to resume from")
    # a list, not a dict by key: the local routed experts' shards share one key (offsets on the expert axis)
    shards = [v for v in nested_values(sharded) if isinstance(v, ShardedBase)]
    loaded = iter(dist_checkpointing.load({"across_chaining": shards}, str(path))["across_chaining"])
    dict_list_map_inplace(lambda v: next(loaded) if isinstance(v, ShardedBase) else
                          v.unwrap() if isinstance(v, LocalNonpersistentObject) else v, sharded)
    for part in chained_parts(sharded):
        part.get("optimizer", part)["state"]["common_step"] = copy.deepcopy(step)
    return sharded


def save_optimizer(opt, model, path: str | Path) -> None:
    """dist_checkpointing save of ``opt``'s sharded state (every rank calls it) into the new folder ``path``."""
    cpu_compat.apply()
    path = Path(path)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    save_sharded(optimizer_sharded_state_dict(opt, model), path)


def load_optimizer(opt, model, path: str | Path) -> None:
    """Restore ``opt`` from ``save_optimizer``'s folder (every rank calls it); errors name the folder. A checkpoint
    of a plain optimizer loads at any layout, also one that chains the experts' optimizer differently
    (``load_across_chaining``); the distributed optimizer's only where it chains as saved."""
    cpu_compat.apply()
    path = Path(path)
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"{path}: no optimizer state (not a Megatron-Core distributed checkpoint)")
    verify_once(path)
    try:
        common = dist_checkpointing.load_common_state_dict(str(path))
        saved, built = len(chained_parts(common)), len(sub_optimizers(opt))
        if saved != built and is_distributed(opt):
            raise ValueError(f"saved by {saved} chained optimizer(s), this layout builds {built}; the distributed "
                             f"optimizer's state (dp_reshardable) loads only at an expert layout that chains as it "
                             f"did: resume at the saved parallel layout")
        sharded = optimizer_sharded_state_dict(opt, model, is_loading=True)
        state = dist_checkpointing.load(sharded, str(path)) if saved == built else \
            load_across_chaining(sharded, common, path)
        opt.load_state_dict(state)
    except (Exception, CheckpointException) as e:
        raise ValueError(f"{path}: could not load the optimizer state ({short_error(e)})") from None


def load_rank_state(root: str | Path, iteration: int, rank: int) -> dict:
    """This rank's ``optimizer/rank_{r}.pt`` (scheduler, RNG), verified; errors name the file."""
    path = iter_dir(root, iteration) / "optimizer" / f"rank_{rank:05d}.pt"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing (saved at another world size or layout?)")
    manifest.verify_under(path)
    try:
        return torch.load(path, weights_only=False)
    except Exception as e:  # a truncated zip, a pickle error: name the file, not a traceback
        raise ValueError(f"{path}: unreadable optimizer state ({type(e).__name__}: {str(e)[:200]})") from None


def read_trainer_state(root: str | Path, iteration: int) -> dict:
    """``iter_N/trainer_state.json``, verified; errors name the file."""
    path = iter_dir(root, iteration) / "trainer_state.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing")
    manifest.verify_under(path)
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None

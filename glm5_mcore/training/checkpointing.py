"""Saving and restoring a training run, one implementation for the SFT recipe and the RL trainer.

- ``save_checkpoint``: one ``DIR/iter_N`` (layout: ``glm5_mcore.checkpoint.layout``) written under a
  temporary name, renamed when complete, then ``latest`` replaced: base weights, adapters, optimizer,
  each rank's scheduler/RNG, ``trainer_state.json``, manifest.
- ``save_run``: a run's periodic save: ``save_checkpoint`` with the scheduler and RNG of every rank, the
  HF meta folder ``DIR/hf`` on the first save, and pruning to the newest ``keep_last`` iterations.
- ``restore_run``: the inverse at an iteration: adapters (or base weights) in place, optimizer,
  scheduler, RNG; returns the trainer state and this rank's saved state (for the caller's extras).
- ``SaveSchedule``: when a run saves: every ``save_every`` steps and, always, the last step it
  reaches (its ``steps``, or an early stop such as ``trainer.stop_at_reward``) — Megatron-LM's rule
  (``training.py``: the final iteration is saved unless it was just saved), so the final weights are
  never lost; ``save_every=0`` saves the last step only.
- ``refuse_restart_over``: ``resume=false`` on a run folder that holds an earlier run's checkpoints
  is refused before any work. Starting a second series there would mix two runs in one folder
  (``keep_last`` pruning one with the other's numbers, ``latest`` and ``metrics.jsonl`` describing
  neither), and would overwrite work this run did not make.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from glm5_mcore.checkpoint import manifest
from glm5_mcore.checkpoint.dist import (load_model, load_optimizer, load_rank_state, read_trainer_state, save_model,
                                        save_optimizer)
from glm5_mcore.checkpoint.layout import (adapter_dir, iter_dir, iterations, prune_iterations, write_hf_meta,
                                          write_latest)
from glm5_mcore.lora.state import load_into, read_adapter_state, save_adapter
from glm5_mcore.training.loop import rng_state, set_rng_state


def save_checkpoint(root: str | Path, iteration: int, model, trainer_state: Optional[dict] = None,
                    adapters: Optional[dict] = None, save_base: bool = True,
                    rank_state: Optional[dict] = None, optimizer=None) -> Path:
    """Write ``DIR/iter_N`` (model, ``adapters/{name}`` for each ``{name: LoRAConfig}`` in
    ``adapters``, trainer_state.json) atomically, then point ``latest`` at it. ``save_base=False``
    skips the (frozen) base weights of a LoRA run. ``optimizer`` (a Megatron optimizer over
    ``model``) is saved with ``save_optimizer`` under ``optimizer/dist``; ``rank_state`` (scheduler,
    RNG) by every rank as ``optimizer/rank_{r}.pt``."""
    root = Path(root)
    final = iter_dir(root, iteration)
    tmp = final.with_name(final.name + ".tmp")
    if dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    if save_base:
        save_model(model, tmp / "model")
    for name, cfg in (adapters or {}).items():
        save_adapter(model, name, tmp / "adapters" / name, cfg)
    if optimizer is not None:
        save_optimizer(optimizer, model, tmp / "optimizer" / "dist")
    if rank_state is not None:
        (tmp / "optimizer").mkdir(exist_ok=True)
        torch.save(rank_state, tmp / "optimizer" / f"rank_{dist.get_rank():05d}.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        (tmp / "trainer_state.json").write_text(json.dumps(trainer_state or {"iteration": iteration}, indent=2))
        manifest.write_manifest(tmp)
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
        write_latest(root, iteration)
    dist.barrier()
    return final


def save_run(root: str | Path, step: int, model, opt, sched, trainer_state: dict, *, adapters: Optional[dict],
             save_base: bool, hf_dir: str | Path, keep_last: int, base_ckpt: Optional[str] = None,
             rank_extra: Optional[dict] = None) -> None:
    """Save iteration ``step`` of a run (every rank calls it): ``save_checkpoint`` with ``opt`` and this
    rank's ``{"scheduler", "rng", **rank_extra}``; on the first save ``DIR/hf`` gets ``hf_dir``'s config
    and tokenizer (and ``base_ckpt``, where a LoRA run's base weights come from); then all but the newest
    ``keep_last`` iterations up to this one are removed (``prune_iterations``: never this one, nor later
    iterations another series left)."""
    root = Path(root)
    rank_state = {"scheduler": sched.state_dict(), "rng": rng_state(), **(rank_extra or {})}
    save_checkpoint(root, step, model, trainer_state, adapters=adapters, save_base=save_base,
                    rank_state=rank_state, optimizer=opt)
    if dist.get_rank() == 0:
        if not (root / "hf").is_dir():
            write_hf_meta(root / "hf", hf_dir, base_ckpt=base_ckpt)
        prune_iterations(root, keep_last, step)
    dist.barrier()


@torch.no_grad()
def restore_run(root: str | Path, iteration: int, model, opt, sched, *, adapters: tuple = (),
                load_base: bool = False, optional_prefixes: tuple = ()) -> tuple[dict, dict]:
    """Restore iteration ``iteration`` of ``root`` in place: each adapter named in ``adapters`` (already
    attached; modules under ``optional_prefixes`` may be absent) or, with ``load_base``, the base weights;
    then the optimizer, scheduler and RNG. Returns (trainer state, this rank's saved state); errors name
    the folder or file."""
    for name in adapters:
        path = adapter_dir(root, name, iteration)
        load_into(model, read_adapter_state(path), name, path, optional_prefixes)
    if load_base:
        load_model(model, iter_dir(root, iteration) / "model")
    rs = load_rank_state(root, iteration, dist.get_rank())
    load_optimizer(opt, model, iter_dir(root, iteration) / "optimizer" / "dist")
    try:
        sched.load_state_dict(rs["scheduler"])
    except (KeyError, ValueError, RuntimeError) as e:
        raise ValueError(f"{iter_dir(root, iteration) / 'optimizer'}: scheduler state does not fit this run "
                         f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
    set_rng_state(rs["rng"])
    return read_trainer_state(root, iteration), rs

"""The checkpoint layout every part of the project reads and writes.

    DIR/
      latest                      the newest complete iteration, as text ("0", "120", ...)
      hf/                         config.json + tokenizer of the model's HF origin, source.json
      iter_{N:07d}/
        model/                    Megatron-Core distributed checkpoint (torch_dist): loads at any TP/EP/PP
        adapters/{name}/          LoRA adapters (the LoRA issue)
        optimizer/                optimizer state: Megatron-Core's sharded optimizer state (Adam moments,
                                  fp32 main params; plain or distributed optimizer) saved with
                                  dist_checkpointing under dist/, and rank_{r}.pt (scheduler, RNG)
        trainer_state.json        step, consumed samples, RNG / data position
        manifest.json             size + digest of every file above (``glm5_mcore.checkpoint.manifest``)

An iteration folder is written under a temporary name and renamed when complete, then ``latest``
is replaced in one rename: a crash leaves the previous iteration as ``latest``. The manifest is
written last, before the rename; every load verifies the files it reads against it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from glm5_mcore import cpu_compat
from glm5_mcore.checkpoint import manifest
from glm5_mcore.checkpoint.atomic import atomic_write_text

HF_META_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja", "tokenizer.model")


class NonFiniteError(ValueError):
    """A weight holds NaN or Inf; the message names the tensor and its file."""


def check_finite(t: torch.Tensor, name: str, where) -> None:
    """Raise ``NonFiniteError`` naming ``name`` (in ``where``) if ``t`` has NaN/Inf values."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise NonFiniteError(f"{where}: tensor {name} has {bad} non-finite value(s) (NaN/Inf); "
                             "--allow-nonfinite converts it anyway")


def short_error(e: BaseException) -> str:
    """One line for a (PyTorch-DCP) load error: the first underlying exception's type and message,
    not the traceback text a ``CheckpointException`` embeds."""
    for f in getattr(e, "failures", {}).values():
        inner = getattr(f, "exc", None) or (f[0] if isinstance(f, tuple) and f else None)
        if isinstance(inner, BaseException):
            e = inner
            break
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:300]}"


def iter_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def iterations(root: str | Path) -> list[int]:
    """The complete iterations under ``root`` (``iter_N`` folders; temporaries are ``iter_N.tmp``), ascending."""
    return sorted(int(p.name[5:]) for p in Path(root).glob("iter_*") if p.is_dir() and p.name[5:].isdigit())


def prune_iterations(root: str | Path, keep: int) -> None:
    """Delete all but the newest ``keep`` iterations (``keep`` <= 0 keeps everything)."""
    if keep > 0:
        for it in iterations(root)[:-keep]:
            shutil.rmtree(iter_dir(root, it), ignore_errors=True)


def latest_iteration(root: str | Path) -> int:
    """The iteration named by ``DIR/latest``; errors name the file."""
    path = Path(root) / "latest"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; {root} is not a glm5-mcore checkpoint folder")
    text = path.read_text().strip()
    if not text.isdigit():
        raise ValueError(f"{path}: expected an iteration number, found {text[:40]!r}")
    it = int(text)
    if not iter_dir(root, it).is_dir():
        raise FileNotFoundError(f"{iter_dir(root, it)}: named by {path} but missing")
    return it


def require_iteration(root: str | Path, iteration: int) -> Path:
    """``DIR/iter_N`` for an asked-for iteration; an error listing the ones that exist otherwise."""
    path = iter_dir(root, iteration)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: iteration {iteration} does not exist in {root} "
                                f"(it has {iterations(root) or 'no iterations'})")
    return path


def write_latest(root: str | Path, iteration: int) -> None:
    atomic_write_text(Path(root) / "latest", f"{iteration}\n")


def model_dir(root: str | Path, iteration: Optional[int] = None) -> Path:
    """``DIR/iter_N/model`` for ``iteration`` (default: ``latest``), or, for a LoRA run that saves
    only adapters, the newest earlier iteration that has base weights, or else the base checkpoint
    the run started from (``base_ckpt`` in ``DIR/hf/source.json``). A Megatron-LM / Megatron-Bridge
    folder: its ``iter_N`` itself (``glm5_mcore.checkpoint.megatron_lm.model_path``)."""
    from glm5_mcore.checkpoint import megatron_lm as foreign_ckpt

    if foreign_ckpt.is_foreign(root):
        return foreign_ckpt.model_path(root, iteration)
    it = latest_iteration(root) if iteration is None else iteration
    require_iteration(root, it)
    for i in reversed(iterations(root)):
        if i <= it and (iter_dir(root, i) / "model").is_dir():
            return iter_dir(root, i) / "model"
    source = Path(root) / "hf" / "source.json"
    base = json.loads(source.read_text()).get("base_ckpt") if source.is_file() else None
    if base:
        return model_dir(base)
    raise FileNotFoundError(f"{iter_dir(root, it) / 'model'}: missing (and no earlier iteration has base weights)")


def write_hf_meta(dst: Path, hf_dir: str | Path, config: Optional[dict] = None,
                  base_ckpt: Optional[str | Path] = None) -> None:
    """Fill ``DIR/hf``: the HF config (``config`` when given), tokenizer files, where they came from
    (``base_ckpt``: the checkpoint a run's base weights are loaded from, for runs that save adapters only),
    and the dtype each HF tensor is stored in (``stored.DTYPES_FILE``: copied from a checkpoint's
    ``hf/``, or read from the weights' headers)."""
    from glm5_mcore.checkpoint.folder_config import DTYPES_FILE, record_dtypes

    dst.mkdir(parents=True, exist_ok=True)
    src = Path(hf_dir)
    for name in HF_META_FILES + (DTYPES_FILE,):
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    if not (src / DTYPES_FILE).is_file() and (any(src.glob("*.safetensors"))
                                              or (src / "model.safetensors.index.json").is_file()):
        (dst / DTYPES_FILE).write_text(json.dumps(record_dtypes(src), indent=1))
    if config is not None:
        (dst / "config.json").write_text(json.dumps(config, indent=2))
    source = {"hf_dir": str(src.resolve())}
    if base_ckpt is not None:
        source["base_ckpt"] = str(Path(base_ckpt).resolve())
    (dst / "source.json").write_text(json.dumps(source, indent=2))


def hf_source_dir(root: str | Path) -> Optional[Path]:
    """The HF folder a checkpoint was converted from, as recorded in ``DIR/hf/source.json``."""
    path = Path(root) / "hf" / "source.json"
    if not path.is_file():
        return None
    return Path(json.loads(path.read_text())["hf_dir"])


def has_hf_weights(folder: str | Path) -> bool:
    """``folder`` holds HF weights (``*.safetensors`` shards or their index), not only config + tokenizer."""
    folder = Path(folder)
    return (folder / "model.safetensors.index.json").is_file() or any(folder.glob("*.safetensors"))


def hf_weights_dir(hf_dir: str | Path, ckpt: Optional[str | Path] = None) -> Optional[Path]:
    """The HF folder with weights for a model given as ``hf_dir`` (+ ``ckpt``): ``hf_dir`` itself when it
    holds weights, else the folder its ``source.json`` names (``write_hf_meta``: a converted checkpoint's
    ``hf/`` has config and tokenizer only), else the one ``ckpt/hf/source.json`` names. None: none has."""
    candidates = [Path(hf_dir)]
    src = Path(hf_dir) / "source.json"
    if src.is_file():
        candidates.append(Path(json.loads(src.read_text())["hf_dir"]))
    if ckpt is not None and hf_source_dir(ckpt) is not None:
        candidates.append(hf_source_dir(ckpt))
    return next((c for c in candidates if has_hf_weights(c)), None)


def verify_once(path: str | Path) -> None:
    """``manifest.verify_under(path)`` shared by every rank: rank r hashes its share of the files
    (``manifest.share``: by size, balanced), all at once, and the verdicts are gathered so that every rank
    raises the same error (the first bad file). 1.5 TB over 64 ranks is ~23 GB each, not 1.5 TB on rank 0
    while the others wait out the process group's timeout (``glm5_mcore.device.dist_timeout``).
    Rank 0 prints what it checks and how fast."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        manifest.verify_under(path)
        return
    import time

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


def save_model(model, path: str | Path) -> None:
    """Megatron-Core distributed save of ``model`` (every rank calls it) into the empty folder ``path``."""
    from megatron.core import dist_checkpointing

    cpu_compat.apply()
    path = Path(path)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(base_sharded_state_dict(model), str(path))


@torch.no_grad()
def load_model(model, path: str | Path, allow_nonfinite: bool = False) -> None:
    """Load a Megatron-Core distributed checkpoint into ``model`` at this process's TP/EP/PP layout,
    its files verified against the iteration's manifest; a NaN/Inf weight is an error naming it.
    Megatron-LM / Bridge checkpoints: the non-tensor state their trainers save beside the weights
    (``checkpoint_version``, ``iteration``, ``args``, ``content_metadata``, ...) is not the model's and is
    left out; tensors stored in another dtype (a bf16 router) are cast to the parameter's."""
    from megatron.core import dist_checkpointing

    cpu_compat.apply()
    path = Path(path)
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"{path}: not a Megatron-Core distributed checkpoint (no metadata.json)")
    verify_once(path)
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        sharded = base_sharded_state_dict(model)
        state = dist_checkpointing.load(dict(sharded), str(path))
    except (Exception, CheckpointException) as e:
        raise ValueError(f"{path}: could not load the checkpoint ({short_error(e)})") from None
    state = {k: v for k, v in state.items() if k in sharded}
    if not allow_nonfinite:
        for k, v in state.items():
            if torch.is_tensor(v):
                check_finite(v, k, path)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state") and ".lora." not in k]
    if missing or unexpected:
        raise ValueError(f"{path}: checkpoint does not fit the model (missing {missing[:5]}, "
                         f"unexpected {unexpected[:5]})")


OPTIMIZER_METADATA = {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False,
                      "chained_optim_avoid_prefix": True}
"""Megatron-LM's sharded-state metadata: the distributed optimizer's buffers saved as they are
sharded over DP (fully parallel, no gather; reshardable over DP), the plain optimizer's state in
parameter space (reshardable over every layout)."""


def _adapters_tp_sharded(sd: dict) -> dict:
    """``sd`` with the TP-sharded LoRA tensors (``tensor_model_parallel`` set by ``lora._tag``) marked
    as sharded: a base linear's ``sharded_state_dict`` covers its ``lora`` child as replicated, so
    TP rank 0's shard alone would be saved. GLU fc1's B is [gate_shard; up_shard] on each rank, as
    Megatron's fc1 weight (``apply_swiglu_sharded_factory``)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint

    out = {}
    for k, v in sd.items():
        p = getattr(v, "data", None) if isinstance(v, ShardedTensor) else None
        if ".lora." in k and p is not None and getattr(p, "tensor_model_parallel", False):
            if v.prepend_axis_num:
                raise ValueError(f"{k}: a TP-sharded adapter with prepended (expert) axes is not supported")
            v = make_tp_sharded_tensor_for_checkpoint(p, v.key, tp_axis=p.partition_dim)
            if ".linear_fc1.lora.B." in k and p.partition_dim == 0 and not k.split(".lora.")[0].endswith(
                    "experts.linear_fc1"):
                v = apply_swiglu_sharded_factory(v, ())
        out[k] = v
    return out


def optimizer_sharded_state_dict(opt, model, is_loading: bool = False) -> dict:
    """Megatron-Core's sharded optimizer state of ``opt`` over ``model``'s parameters (the plain
    optimizer's per-parameter state, or the distributed optimizer's moments and fp32 main params)."""
    model_sd = _adapters_tp_sharded(model.sharded_state_dict())
    return opt.sharded_state_dict(model_sd, is_loading=is_loading, metadata=dict(OPTIMIZER_METADATA))


def save_optimizer(opt, model, path: str | Path) -> None:
    """dist_checkpointing save of ``opt``'s sharded state (every rank calls it) into the new folder ``path``."""
    from megatron.core import dist_checkpointing

    cpu_compat.apply()
    path = Path(path)
    if dist.get_rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(optimizer_sharded_state_dict(opt, model), str(path))


def load_optimizer(opt, model, path: str | Path) -> None:
    """Restore ``opt`` from ``save_optimizer``'s folder (every rank calls it); errors name the folder."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    cpu_compat.apply()
    path = Path(path)
    if not (path / "metadata.json").is_file():
        raise FileNotFoundError(f"{path}: no optimizer state (not a Megatron-Core distributed checkpoint)")
    verify_once(path)
    try:
        state = dist_checkpointing.load(optimizer_sharded_state_dict(opt, model, is_loading=True), str(path))
        opt.load_state_dict(state)
    except (Exception, CheckpointException) as e:
        raise ValueError(f"{path}: could not load the optimizer state ({type(e).__name__}: {str(e)[:500]})") from None


def adapter_dir(root: str | Path, name: str, iteration: Optional[int] = None) -> Path:
    """``DIR/iter_N/adapters/{name}`` (default: the ``latest`` iteration); errors name the folder."""
    from glm5_mcore.checkpoint import megatron_lm as foreign_ckpt

    if foreign_ckpt.is_foreign(root):
        raise ValueError(f"{root}: a Megatron-LM / Megatron-Bridge checkpoint has no adapters/{name} folder; "
                         "`glm5 lora export --ckpt` turns a Bridge LoRA checkpoint's adapter into an HF PEFT folder")
    it = latest_iteration(root) if iteration is None else iteration
    path = require_iteration(root, it) / "adapters" / name
    if not path.is_dir():
        have = sorted(p.name for p in (iter_dir(root, it) / "adapters").glob("*")) if (
            iter_dir(root, it) / "adapters").is_dir() else []
        raise FileNotFoundError(f"{path}: no adapter {name!r} in this checkpoint (have {have})")
    return path


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
        from glm5_mcore.lora.state import save_adapter

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

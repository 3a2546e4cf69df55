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

This module holds the paths and the HF meta folder; the distributed-checkpoint I/O of an iteration is
``glm5_mcore.checkpoint.dist``, the writer of a whole iteration ``glm5_mcore.training.checkpointing``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Optional

from glm5_mcore.checkpoint import megatron_lm
from glm5_mcore.checkpoint.atomic import atomic_write_text
from glm5_mcore.checkpoint.dtypes import DTYPES_FILE, record_dtypes

HF_META_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja", "tokenizer.model")


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
    if megatron_lm.is_foreign(root):
        return megatron_lm.model_path(root, iteration)
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
    and the dtype each HF tensor is stored in (``dtypes.DTYPES_FILE``: copied from a checkpoint's
    ``hf/``, or read from the weights' headers)."""
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


def adapter_dir(root: str | Path, name: str, iteration: Optional[int] = None) -> Path:
    """``DIR/iter_N/adapters/{name}`` (default: the ``latest`` iteration); errors name the folder."""
    if megatron_lm.is_foreign(root):
        raise ValueError(f"{root}: a Megatron-LM / Megatron-Bridge checkpoint has no adapters/{name} folder; "
                         "`glm5 lora export --ckpt` turns a Bridge LoRA checkpoint's adapter into an HF PEFT folder")
    it = latest_iteration(root) if iteration is None else iteration
    path = require_iteration(root, it) / "adapters" / name
    if not path.is_dir():
        have = sorted(p.name for p in (iter_dir(root, it) / "adapters").glob("*")) if (
            iter_dir(root, it) / "adapters").is_dir() else []
        raise FileNotFoundError(f"{path}: no adapter {name!r} in this checkpoint (have {have})")
    return path

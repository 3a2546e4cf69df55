"""The checkpoint layout every part of the project reads and writes.

    DIR/
      latest                      the newest complete iteration, as text ("0", "120", ...)
      hf/                         config.json + tokenizer of the model's HF origin, source.json
      iter_{N:07d}/
        model/                    Megatron-Core distributed checkpoint (torch_dist): loads at any TP/EP/PP
                                  (the embedding / output layer with the saving layout's padded vocabulary
                                  rows, read by Megatron-Core's allow_shape_mismatch: ``model.vocab``)
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

from glm5_mcore.checkpoint import manifest, megatron_lm
from glm5_mcore.checkpoint.atomic import atomic_write_text
from glm5_mcore.checkpoint.dtypes import DTYPES_FILE, record_dtypes
from glm5_mcore.checkpoint.origin import KEY as ORIGIN_KEY
from glm5_mcore.checkpoint.origin import recorded_fingerprint, weights_fingerprint

HF_META_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja", "tokenizer.model")


def iter_dir(root: str | Path, iteration: int) -> Path:
    return Path(root) / f"iter_{iteration:07d}"


def iterations(root: str | Path) -> list[int]:
    """The complete iterations under ``root`` (``iter_N`` folders; temporaries are ``iter_N.tmp``), ascending."""
    return sorted(int(p.name[5:]) for p in Path(root).glob("iter_*") if p.is_dir() and p.name[5:].isdigit())


def prune_iterations(root: str | Path, keep: int, newest: int) -> list[int]:
    """Delete all but the ``keep`` newest iterations up to ``newest`` (the one just saved, which
    ``latest`` names); ``keep`` <= 0 keeps everything. Iterations after ``newest`` are not this
    series' and are never touched (a pruning by number alone would delete the checkpoint just
    written when the folder holds later ones). Returns the iterations deleted."""
    if keep <= 0:
        return []
    gone = [it for it in iterations(root) if it <= newest][:-keep]
    for it in gone:
        shutil.rmtree(iter_dir(root, it), ignore_errors=True)
    return gone


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


def verify_checkpoint(root: str | Path) -> list[tuple[Path, int]]:
    """``glm5 checkpoint verify``: a checkpoint folder's ``latest`` names an iteration that is there
    (what every loader needs; ``latest_iteration``'s error otherwise; a Megatron-LM folder: its tracker
    file), then every manifest folder verified strictly (``manifest.verify_tree``). Returns [(folder,
    files checked)]."""
    root = Path(root)
    if megatron_lm.is_foreign(root):  # Megatron-LM / Bridge layout: its tracker file names the iteration
        megatron_lm.model_path(root, None)
    elif (root / "latest").exists() or (root.is_dir() and iterations(root)):
        latest_iteration(root)
    return manifest.verify_tree(root)


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
    the fingerprint of the HF origin's weights (``origin``: of ``hf_dir``'s weights, or the one a checkpoint's
    ``hf/`` records), and the dtype each HF tensor is stored in (``dtypes.DTYPES_FILE``: copied from a
    checkpoint's ``hf/``, or read from the weights' headers)."""
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
    fingerprint = weights_fingerprint(src) if has_hf_weights(src) else recorded_fingerprint(src)
    if fingerprint is not None:
        source[ORIGIN_KEY] = fingerprint
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


def serving_dir(hf_dir: str | Path, ckpt: Optional[str | Path] = None, explicit: Optional[str | Path] = None) -> str:
    """The HF folder an inference engine loads (RL's ``rollout.hf_dir`` = ``explicit``, else ``hf_weights_dir``);
    a folder without weights is a ValueError naming it and the field to set (vLLM would stop with "Cannot
    find any model weights")."""
    if explicit:
        if not has_hf_weights(explicit):
            raise ValueError(f"rollout.hf_dir={explicit}: no *.safetensors weights there")
        return str(explicit)
    found = hf_weights_dir(hf_dir, ckpt)
    if found is None:
        raise ValueError(f"model.hf_dir={hf_dir}: holds no *.safetensors weights (config and tokenizer only"
                         f"{', nor does the HF folder model.ckpt was converted from' if ckpt else ''}); the rollout "
                         "engines need them: set rollout.hf_dir=<the HF folder with the weights>")
    return str(found)

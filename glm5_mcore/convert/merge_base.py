"""The base weights a LoRA run's adapter is merged onto, as a checkpoint the streaming converter reads.

A LoRA run saves adapters only. Its base weights are, in this order: ``--base`` when given (a
glm5-mcore / Megatron-LM / Bridge checkpoint, or an HF folder), the newest iteration up to the asked
one that holds ``model/`` (a full fine-tuning stage), the checkpoint the run started from (``base_ckpt``
in ``DIR/hf/source.json``), or else the run's HF origin (``hf_dir`` there: an SFT or RL run started from
``model.hf_dir``). An HF folder is first converted into the caller's scratch folder (``hf_to_mcore``);
the architecture of an explicit ``--base`` is checked against the run's, and so is its origin: the fingerprint of
its weights (an HF folder's own, a glm5-mcore checkpoint's recorded origin; ``checkpoint.origin``) must be the
one the run recorded of its HF origin, or the merge is refused naming both unless ``allow_other_base``
(``--allow-other-base``): an adapter merged onto weights it was not trained on is a model of neither, and
nothing in its bytes says so. Where either side records no fingerprint (a Megatron-LM checkpoint, a run from
before they were recorded) a notice says it was not compared. Used by ``glm5 lora export --merged`` and
``glm5 checkpoint export --merge-adapter``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from glm5_mcore.checkpoint.folder_config import checkpoint_config, hf_dir_config, notice
from glm5_mcore.checkpoint.layout import hf_source_dir, model_dir
from glm5_mcore.checkpoint.megatron_lm import check_same_arch, is_foreign
from glm5_mcore.checkpoint.origin import recorded_fingerprint, weights_fingerprint
from glm5_mcore.convert.hf_to_mcore import hf_to_mcore


def _is_hf_folder(path: Path) -> bool:
    return (path / "config.json").is_file() and not (path / "latest").exists() and not (path / "hf").is_dir()


def check_origin(base: Path, root: Path, allow_other_base: bool) -> None:
    """``--base`` holds the weights the run ``root`` was trained on, by their fingerprints (module docstring)."""
    ours = recorded_fingerprint(root / "hf")
    theirs = None if is_foreign(base) else weights_fingerprint(base) if _is_hf_folder(base) else \
        recorded_fingerprint(base / "hf")
    if ours is None or theirs is None:
        notice(f"--base {base}: not compared with the weights the run {root} was trained on ("
               f"{'the run' if ours is None else base} records no fingerprint of its HF origin)")
    elif ours != theirs and not allow_other_base:
        raise ValueError(f"--base {base}: not the weights the run {root} was trained on (its HF origin "
                         f"{hf_source_dir(root)}: weights sha256 {ours[:12]}, --base: {theirs[:12]}); pass "
                         "--allow-other-base to merge onto it anyway")
    elif ours != theirs:
        notice(f"--base {base}: other weights than the run's HF origin ({theirs[:12]}, trained on {ours[:12]}), "
               "merged onto as --allow-other-base asks")


def base_checkpoint(root: str | Path, iteration: Optional[int], work: Path,
                    base: Optional[str | Path] = None, allow_other_base: bool = False) -> tuple[Path, Optional[int]]:
    """(checkpoint folder, iteration or None for its latest) holding the base weights of ``root``'s
    ``iteration``; an HF folder is converted under ``work`` (the caller's scratch folder, removed by it).
    Errors name the folder and the way out (``--base``; ``--allow-other-base``)."""
    root = Path(root)
    if base is not None:
        base = Path(base)
        if not base.exists():
            raise FileNotFoundError(f"--base {base}: does not exist")
        theirs = hf_dir_config(base, quiet=True) if _is_hf_folder(base) else checkpoint_config(base, quiet=True)
        check_same_arch(theirs, checkpoint_config(root, iteration, quiet=True), f"--base {base}", f"the run {root}")
        check_origin(base, root, allow_other_base)
        return (hf_to_mcore(base, work / "base", progress=False), None) if _is_hf_folder(base) else (base, None)
    try:
        model_dir(root, iteration)
        return root, iteration
    except FileNotFoundError:
        origin = hf_source_dir(root)
        if origin is None or not (origin / "config.json").is_file():
            raise FileNotFoundError(f"{root}: no base weights saved, and its HF origin ({origin}, "
                                    f"{root / 'hf' / 'source.json'}) is missing; pass --base DIR") from None
    return hf_to_mcore(origin, work / "base", progress=False), None

"""Resume guards shared by SFT and RL: a run's output folder and the settings a resume must keep.

A run records, in every iteration's ``trainer_state.json`` under ``"settings"``, the settings that
must not change across a resume (data files with their size and xxh3 digest, batch sizes, LoRA
rank/alpha/targets, the model's config digest, the parallel layout the per-rank optimizer files
were saved at). A resume compares them with the new run's and refuses any difference, naming each
field with its old and new value, unless ``allow_resume_mismatch`` (``train.`` in SFT, ``trainer.``
in RL) is set. ``claim_run_dir`` is the ``--out`` guard of a training run's folder, ``refuse_restart_over``
the ``resume=false`` one, ``SaveSchedule`` which steps a run saves. Nothing here imports Megatron-Core: the
RL driver (which never builds a model) uses it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterable, Optional

from glm5_mcore.checkpoint.atomic import check_output, output_kind, write_marker
from glm5_mcore.checkpoint.layout import iterations, latest_iteration
from glm5_mcore.checkpoint.manifest import file_digest

SWITCH = "allow_resume_mismatch"


def file_fingerprint(path: Optional[str]) -> Any:
    """{"size", "xxh3"} of a data file (a moved but unchanged file is the same data); of a folder (an HF
    ``save_to_disk`` dataset, a dataset dict's split folders) {"files": {relative path: {"size", "xxh3"}}}
    of every file under it, so a rewritten arrow shard or ``state.json`` counts as changed data; None or
    a name such as ``toy`` as is."""
    if not path:
        return path
    p = Path(path)
    if p.is_dir():
        return {"files": {f.relative_to(p).as_posix(): file_fingerprint(str(f))
                          for f in sorted(p.rglob("*")) if f.is_file()}}
    if not p.is_file():
        return path
    return {"size": p.stat().st_size, "xxh3": file_digest(path)}


def model_fingerprint(hf_dir: Optional[str], ckpt: Optional[str] = None) -> dict:
    """The model a run trains: its HF config's digest (architecture and sizes) and base checkpoint."""
    out: dict = {"ckpt": str(Path(ckpt).resolve()) if ckpt else None}
    cfg = Path(ckpt) / "hf" / "config.json" if ckpt else Path(hf_dir or "") / "config.json"
    if cfg.is_file():
        out["config_xxh3"] = file_digest(cfg)
    return out


def _flat(d: Any, prefix: str = "") -> dict:
    if isinstance(d, dict):
        out = {}
        for k, v in d.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: d}


def compare(recorded: dict, current: dict, notes: Optional[dict] = None) -> list[str]:
    """``field: old -> new`` for every setting that differs (a field only one side has counts), followed by
    ``(notes[field])`` where ``notes`` says what the change does."""
    a, b = _flat(json.loads(json.dumps(recorded))), _flat(json.loads(json.dumps(current)))
    notes = notes or {}
    return [f"{k}: {a.get(k, '<absent>')!r} -> {b.get(k, '<absent>')!r}" + (f" ({notes[k]})" if k in notes else "")
            for k in sorted(set(a) | set(b)) if a.get(k, "<absent>") != b.get(k, "<absent>")]


def guard_resume(root: str | Path, current: dict, proceed: bool, section: str,
                 notes: Optional[dict] = None) -> Optional[int]:
    """Before resuming from ``root``'s latest iteration: refuse (``ValueError`` naming each field, with its
    ``notes``) if its recorded settings differ from ``current``, unless ``proceed`` (then print them). Returns
    the iteration to resume, or None when ``root`` has no checkpoint."""
    from glm5_mcore.checkpoint.dist import read_trainer_state  # here: dist imports Megatron (cpu_compat)

    if not (Path(root) / "latest").is_file():
        return None
    it = latest_iteration(root)
    state = read_trainer_state(root, it)
    recorded = state.get("settings")
    if recorded is None:
        return it  # a checkpoint from before settings were recorded
    diffs = compare(recorded, current, notes)
    if diffs and not proceed:
        raise ValueError(f"{Path(root) / 'latest'}: resuming iteration {it} with settings that differ from "
                         f"the run's: {'; '.join(diffs)} (set {section}.{SWITCH}=true to resume anyway, "
                         f"or a new {section}.out to start over)")
    if diffs:
        print(f"warning: resuming {root} with changed settings: {'; '.join(diffs)}", file=sys.stderr)
    return it


def claim_run_dir(out: str | Path, kind: str, inputs: Iterable = ()) -> None:
    """A training run's output folder: absent, empty or a previous ``kind`` run's folder (which it
    resumes or extends), never an input or a folder of something else; marks it as ``kind``'s."""
    check_output(out, kind, inputs, overwrite=False, what=f"the {kind} output folder",
                 hint="choose another output folder")
    Path(out).mkdir(parents=True, exist_ok=True)
    if output_kind(out) != kind:
        write_marker(out, kind)


class SaveSchedule:
    """Which steps a run saves: every ``save_every`` (0: none but the last) and the last one."""

    def __init__(self, save_every: int, start_step: int):
        self.every = save_every
        self.saved = start_step  # a resumed run's checkpoint is already on disk

    def due(self, step: int) -> bool:
        """A periodic checkpoint is due after ``step``."""
        return bool(self.every) and step % self.every == 0 and step != self.saved

    def final_due(self, step: int) -> bool:
        """The last step reached has no checkpoint yet."""
        return step != self.saved

    def done(self, step: int) -> None:
        self.saved = step


def refuse_restart_over(out: str | Path, section: str) -> None:
    """``{section}.resume=false`` on ``out``: refused (``ValueError`` naming the folder and the ways
    out) when it holds a checkpoint (``latest`` or an ``iter_N`` folder); nothing is touched."""
    out = Path(out)
    its = iterations(out) if out.is_dir() else []
    if not its and not (out / "latest").exists():
        return
    latest = (out / "latest").read_text().strip()[:20] if (out / "latest").is_file() else "none"
    shown = ", ".join(map(str, its[-4:])) + (f" and {len(its) - 4} more" if len(its) > 4 else "")
    raise ValueError(f"{out}: {section}.resume=false, but the folder holds an earlier run's checkpoints "
                     f"(iterations {shown or 'none'}, latest {latest}); set {section}.resume=true to continue "
                     f"that run, or give a new {section}.out to start over (nothing was changed)")

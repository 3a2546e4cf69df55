"""When a training run saves, shared by SFT (``recipes/sft.py``) and RL (``rl/driver.py``).

- ``SaveSchedule``: a checkpoint every ``save_every`` steps and, always, one of the last step a
  run reaches (its ``steps``, or an early stop such as ``trainer.stop_at_reward``) — Megatron-LM's
  rule (``training.py``: the final iteration is saved unless it was just saved), so the final
  weights are never lost; ``save_every=0`` saves the last step only.
- ``refuse_restart_over``: ``resume=false`` on a run folder that holds an earlier run's checkpoints
  is refused before any work. Starting a second series there would mix two runs in one folder
  (``keep_last`` pruning one with the other's numbers, ``latest`` and ``metrics.jsonl`` describing
  neither), and would overwrite work this run did not make.
"""

from __future__ import annotations

from pathlib import Path

from glm5_mcore.checkpoint.layout import iterations


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

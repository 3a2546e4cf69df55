"""``glm5 lora export``: a checkpoint's adapter as an HF PEFT folder (``lora.peft``), or merged into its
base weights as a full HF checkpoint (``convert.mcore_to_hf``). Reads our checkpoints and Megatron-Bridge
PEFT checkpoints (``lora.bridge_peft``). The command sits above both formats, so neither imports the other."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Optional

from glm5_mcore.checkpoint.atomic import check_output, scratch_dir
from glm5_mcore.checkpoint.folder_config import checkpoint_config
from glm5_mcore.checkpoint.layout import adapter_dir
from glm5_mcore.checkpoint.megatron_lm import check_same_arch, is_foreign
from glm5_mcore.config import GLM5Config
from glm5_mcore.convert.mcore_to_hf import mcore_to_hf
from glm5_mcore.convert.merge_base import base_checkpoint
from glm5_mcore.lora.bridge_peft import read_bridge_adapter
from glm5_mcore.lora.peft import export_peft
from glm5_mcore.lora.state import read_adapter_state


def export_checkpoint_adapter(ckpt: str | Path, out: str | Path, adapter: str = "default",
                              iteration: Optional[int] = None, merged: bool = False,
                              max_shard_size: str = "5GB", progress: bool = True,
                              overwrite: bool = False, allow_nonfinite: bool = False,
                              base: Optional[str | Path] = None, allow_other_base: bool = False) -> Path:
    """``glm5 lora export``: the checkpoint's adapter as an HF PEFT folder, or (``merged``) a full HF
    checkpoint of the base weights with the adapter merged in (before experts are split per expert).
    Our runs' base weights for ``merged``: ``base`` when given, else what the run records
    (``glm5_mcore.convert.merge_base``: saved base weights, its base checkpoint, or its HF origin; a ``base``
    of other weights than the run's recorded origin is refused unless ``allow_other_base``). A
    Megatron-Bridge PEFT checkpoint (``glm5_mcore.lora.bridge_peft``) is read too; its base weights for
    ``merged`` are ``base``, else the ``checkpoint.pretrained_checkpoint`` its run_config.yaml names."""
    root = Path(ckpt)
    check_output(out, "lora export", [root, base], overwrite)
    if is_foreign(root):
        return _export_foreign_adapter(root, out, adapter, iteration, merged, max_shard_size, progress,
                                       overwrite, allow_nonfinite, base)
    if base is not None and not merged:
        raise ValueError(f"--base {base}: the base weights to merge onto; it applies with --merged only")
    state = read_adapter_state(adapter_dir(root, adapter, iteration))
    glm5 = GLM5Config.from_hf_dir(root / "hf")
    if merged:
        work = scratch_dir(Path(out).absolute().parent, ".glm5-export-")  # a killed run's is removed by the next
        try:
            src, it = base_checkpoint(root, iteration, work, base, allow_other_base)
            return mcore_to_hf(src, out, max_shard_size, it, progress, merge_adapter=state,
                               overwrite=overwrite, kind="lora export", allow_nonfinite=allow_nonfinite)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return export_peft(state, glm5.num_hidden_layers, glm5.n_routed_experts, out, base_model=str(root / "hf"),
                       inputs=[root], overwrite=overwrite)


def _export_foreign_adapter(root: Path, out, adapter: str, iteration, merged: bool, max_shard_size: str,
                            progress: bool, overwrite: bool, allow_nonfinite: bool, base) -> Path:
    """``export_checkpoint_adapter`` for a Megatron-Bridge PEFT checkpoint."""
    if adapter != "default":
        raise ValueError(f"{root}: a Megatron-Bridge checkpoint holds one adapter; --adapter {adapter} does not apply")
    fa = read_bridge_adapter(root, iteration)
    if not merged:
        return export_peft(fa.state, fa.config.num_hidden_layers, fa.config.n_routed_experts, out,
                           base_model=fa.base_model, inputs=[root], overwrite=overwrite)
    given = base is not None
    base = base if given else fa.base
    if not base:
        raise ValueError(f"{fa.path}: run_config.yaml names no checkpoint.pretrained_checkpoint; "
                         "pass --base DIR with the base weights the adapter was trained on")
    if not Path(base).exists():
        raise FileNotFoundError(f"{base}: the base checkpoint ({'--base' if given else 'run_config.yaml'}"
                                f"{'' if given else ' checkpoint.pretrained_checkpoint'}) does not exist; pass --base DIR")
    check_same_arch(fa.config, checkpoint_config(base, quiet=True), f"{fa.path} (run_config.yaml)", f"the base {base}")
    check_output(out, "lora export", [root, base], overwrite)
    return mcore_to_hf(base, out, max_shard_size, None, progress, merge_adapter=fa.state,
                       overwrite=overwrite, kind="lora export", allow_nonfinite=allow_nonfinite)

"""Where a training run's model comes from, resolved once: the one training-side place that knows the
three kinds of folder ``model.hf_dir`` / ``model.ckpt`` may name.

- an HF folder (``model.hf_dir``): config, tokenizer and the base weights;
- a glm5-mcore checkpoint (``model.ckpt``: ``glm5 convert hf-to-mcore``, an SFT run): base weights of its
  latest iteration, config and tokenizer from its ``hf/`` unless ``model.hf_dir`` is given;
- a Megatron-LM / Megatron-Bridge checkpoint (``model.ckpt``): its own config checked field by field
  against ``model.hf_dir``'s (which must be given: tokenizer and HF config), MTP only when it stores it.

``resolve_model(model_cfg)`` returns a ``ModelSource``: the ``GLM5Config`` to build (MTP layers as
``model.mtp`` says and the weights allow), the HF folder of the tokenizer, and ``load_weights(model)``.
The SFT recipe, the RL trainer and the parity tool build from it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from glm5_mcore.checkpoint import megatron_lm
from glm5_mcore.checkpoint.dist import load_model
from glm5_mcore.checkpoint.folder_config import checkpoint_config, hf_dir_config, notice
from glm5_mcore.checkpoint.fp8_sharded import stored_block
from glm5_mcore.checkpoint.hf_io import weight_block_size
from glm5_mcore.checkpoint.hf_load import load_hf_weights
from glm5_mcore.checkpoint.layout import model_dir
from glm5_mcore.config import GLM5Config
from glm5_mcore.model.fp8_linear import check_base_dtype
from glm5_mcore.training.schema import ModelCfg


@dataclass
class ModelSource:
    """A resolved ``model`` section: build ``glm5``, tokenizer and HF meta from ``hf_dir``, weights from
    ``ckpt`` (ours or Megatron-LM's, ``foreign``) or else ``hf_dir``; ``fresh_mtp``: the MTP layers start
    from Megatron-Core's initialisation (``model.mtp=init``)."""

    hf_dir: str
    ckpt: Optional[str]
    glm5: GLM5Config
    fresh_mtp: bool = False
    foreign: bool = False
    base_fp8_block: Optional[int] = None
    """``model.base_dtype=fp8``: the block size of the frozen FP8 base (the weights folder's, else 128)."""

    def load_weights(self, model) -> None:
        """The base weights into ``model`` (built from ``self.glm5`` at this rank's layout)."""
        if self.ckpt:
            load_model(model, model_dir(self.ckpt))
        else:
            load_hf_weights(model, self.hf_dir, self.glm5, skip_prefixes=("mtp.",) if self.fresh_mtp else ())


def hf_dir_of(model: ModelCfg) -> str:
    """The HF folder of the config and tokenizer: ``model.hf_dir``, else a glm5-mcore checkpoint's ``hf/``."""
    if model.hf_dir:
        return model.hf_dir
    if model.ckpt:
        if megatron_lm.is_foreign(model.ckpt):
            raise ValueError(f"model.ckpt={model.ckpt}: a Megatron-LM / Megatron-Bridge checkpoint; give "
                             "model.hf_dir too (the HF config and tokenizer)")
        return str(Path(model.ckpt) / "hf")
    raise ValueError("model.hf_dir or model.ckpt must be given")


def resolve_model(model: ModelCfg, lora_enabled: bool = False) -> ModelSource:
    """The ``ModelSource`` of a ``model`` section; ``lora_enabled``: the run trains adapters only (then
    ``model.mtp=init``, a whole fresh layer, is refused). Errors name the field or the folder."""
    check_base_dtype(model.base_dtype, trains_base=False)
    source = _resolve(model, lora_enabled)
    if model.base_dtype == "fp8":
        source.base_fp8_block = base_fp8_block(source)
    return source


def base_fp8_block(source: ModelSource) -> int:
    """The block size a frozen FP8 base is built in: that of the FP8 weights ``model.ckpt`` stores
    (``checkpoint.fp8_sharded``: loaded as stored), else the HF folder's (a dense checkpoint or folder is
    quantized once in it)."""
    if source.ckpt:
        stored = stored_block(model_dir(source.ckpt))
        if stored is not None:
            return stored
    return weight_block_size(source.hf_dir)


def _resolve(model: ModelCfg, lora_enabled: bool) -> ModelSource:
    hf_dir = hf_dir_of(model)
    mode = model.mtp
    if mode not in ("auto", "init", "off"):
        raise ValueError(f"model.mtp: expected auto, init or off, got {mode!r}")
    foreign = bool(model.ckpt) and megatron_lm.is_foreign(model.ckpt)
    declared = GLM5Config.from_hf_dir(hf_dir)
    if mode == "off":
        glm5 = dataclasses.replace(declared, num_nextn_predict_layers=0)
        return ModelSource(hf_dir, model.ckpt, megatron_lm.glm5_config(model.ckpt, glm5) if foreign else glm5,
                           False, foreign)
    if mode == "init" and declared.num_nextn_predict_layers == 0:
        raise ValueError(f"model.mtp=init: {hf_dir}/config.json declares num_nextn_predict_layers=0")
    if foreign:  # Megatron-LM / Bridge: its own config checked against the HF one, MTP as stored
        stored = megatron_lm.glm5_config(model.ckpt, declared)
    elif model.ckpt:
        stored = checkpoint_config(model.ckpt, quiet=mode == "init")
    else:
        stored = hf_dir_config(hf_dir, quiet=mode == "init")
    if mode == "auto" or stored.num_nextn_predict_layers == declared.num_nextn_predict_layers:
        return ModelSource(hf_dir, model.ckpt, stored, False, foreign)
    if lora_enabled:
        raise ValueError("model.mtp=init trains a whole fresh MTP layer, which a LoRA run neither trains nor "
                         "saves: set lora.enabled=false (or model.mtp=auto)")
    if stored.num_nextn_predict_layers or model.ckpt:
        raise ValueError(f"model.mtp=init: {model.ckpt or hf_dir} stores {stored.num_nextn_predict_layers} of "
                         f"{declared.num_nextn_predict_layers} MTP layers; init starts all of them fresh from an "
                         "HF folder (model.hf_dir) that stores none")
    notice(f"{hf_dir}: model.mtp=init: {declared.num_nextn_predict_layers} MTP layer(s) initialised fresh and trained")
    return ModelSource(hf_dir, None, declared, True, False)

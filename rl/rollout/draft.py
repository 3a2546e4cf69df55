"""What a rollout engine does with GLM-5's MTP layer (the speculative-decoding draft; the trainer trains it,
``rl.train.mtp``).

- ``mtp_speculative_config``: vLLM's ``speculative_config`` drafting with the checkpoint's own MTP layer.
- ``adapter_without_mtp``: a pushed adapter without the MTP layer's tensors, for an engine that has no MTP
  module to load them into.
"""

from __future__ import annotations

import re

from safetensors.torch import load, save


def mtp_speculative_config(config: dict, num_tokens: int, source: str) -> dict:
    """vLLM's ``speculative_config`` drafting ``num_tokens`` tokens with the checkpoint's own MTP layer
    (``method="mtp"``: vLLM 0.32 serves GLM-5's ``model.layers.{num_hidden_layers}`` as the draft
    model); ``config`` is the folder's config.json. A folder declaring no MTP layer is refused."""
    if num_tokens < 1:
        raise ValueError(f"rollout.engine_kwargs.mtp_draft_tokens={num_tokens} must be >= 1")
    if not config.get("num_nextn_predict_layers"):
        raise ValueError(f"rollout.engine_kwargs.mtp_draft_tokens={num_tokens}: {source}/config.json declares "
                         "num_nextn_predict_layers=0, there is no MTP layer to draft with")
    return {"method": "mtp", "num_speculative_tokens": int(num_tokens)}


def adapter_without_mtp(files: dict, num_hidden_layers: int) -> dict:
    """The PEFT payload ``files`` (adapter_config.json / adapter_model.safetensors bytes) without the MTP
    layer's tensors (``model.layers.{>= num_hidden_layers}.*``): for a model that has no MTP module
    (transformers' GLM-5; vLLM's LoRA mode leaves them out itself, ``rl.rollout.vllm_lora``). The same bytes
    back when there are none."""
    name = "adapter_model.safetensors"
    if name not in files:
        return files
    tensors = load(files[name])
    layer = re.compile(r"(?:^|\.)model\.layers\.(\d+)\.")
    keep = {k: v for k, v in tensors.items() if not ((m := layer.search(k)) and int(m.group(1)) >= num_hidden_layers)}
    if len(keep) == len(tensors):
        return files
    return {**files, name: save(keep, metadata={"format": "pt"})}

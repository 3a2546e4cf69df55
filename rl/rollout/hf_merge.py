"""The HF engine's adapter merged into its base weights (``HFRolloutEngine(merge_lora=True)``, the default).

PEFT's unmerged layers cost every forward two extra GEMMs per targeted linear — for MLA's ``kv_b_proj`` over
every cached latent, which transformers expands at each decode step — and a routed-expert ``ParamWrapper``
rebuilds W + ΔW through a parametrization at each call. Measured on the tiny GLM-5 (one CPU thread, a decode
forward of 52 rows over 76 cached columns, LoRA on MLA and the MLPs): 7.9 ms without an adapter, 12.2 ms with
PEFT's layers, 7.9 ms merged. A rollout engine holds one adapter at a time and never trains it, so merging
loses nothing; the served values differ from the unmerged layers' by float rounding only (W + s·BA is
rounded once).

Every load merges into the **pristine** base weights (kept once, on the host), never into the previous
merge: PEFT's ``unmerge_adapter`` subtracts ΔW in floating point, so a base unmerged and merged at every push
would drift from the checkpoint's values.
"""

from __future__ import annotations

import torch


def tuner_layers(model) -> list:
    """PEFT's tuner layers of ``model`` (``BaseTunerLayer``s, known by their interface: importing peft costs a
    driver that only validates the config 3.4 s)."""
    return [m for m in model.modules() if hasattr(m, "merged_adapters") and hasattr(m, "get_base_layer")]


def base_param(layer) -> torch.nn.Parameter:
    """The base tensor a LoRA layer merges into: a linear's ``weight``, a ``ParamWrapper``'s parameter."""
    base = layer.get_base_layer()
    name = getattr(layer, "parameter_name", None)
    return getattr(base, name) if name else base.weight


class MergedLoRA:
    """The LoRA layers of ``peft_model`` and a host copy of each base tensor they merge into."""

    def __init__(self, peft_model):
        self.peft = peft_model
        self.layers = tuner_layers(peft_model)
        for m in self.layers:
            if any(getattr(m, "lora_bias", {}).values()) or getattr(m, "lora_variant", None):
                raise ValueError(f"{type(m).__name__}: only plain LoRA (no bias, no DoRA or other variant) is merged; "
                                 "rollout.engine_kwargs.merge_lora=false serves it unmerged")
        params = {id(p): p for p in map(base_param, self.layers)}
        self.pristine = [(p, p.detach().to("cpu", copy=True)) for p in params.values()]

    def restore(self) -> None:
        """The base weights as loaded, every layer unmerged (PEFT's bookkeeping cleared, nothing subtracted)."""
        for m in self.layers:
            m.merged_adapters.clear()
        with torch.no_grad():
            for p, saved in self.pristine:
                p.copy_(saved)

    def merge(self) -> None:
        """The loaded adapter's ΔW added to the pristine base: forwards run the plain linears."""
        self.restore()
        self.peft.merge_adapter()

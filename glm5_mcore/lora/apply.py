"""LoRA on a whole GLM-5 model: ``apply_lora(model, cfg, name)`` attaches a ``LoRALayer`` (``lora.layers``:
the tensor-parallel math) to each linear of ``cfg.targets`` (``lora.config``) as its ``lora`` submodule, with
a forward hook: the base module's own forward always runs unchanged, and the low-rank delta
``scale · B(A(dropout(x)))`` is added to its output afterwards. Several named adapters can live on one
model; one is active per forward (``set_adapter``), ``disable_adapters`` turns them all off (the RL
reference policy), ``merge``/``unmerge`` fold the active one into the base weight. Adapters are named
by global module path (``global_module_name``), so every TP/EP/PP layout gets the same adapter.
"""

from __future__ import annotations

import contextlib
import re
from typing import Iterator, Optional

import torch

from glm5_mcore.lora.config import INDEXER, LoRAConfig, family_of
from glm5_mcore.lora.grouped import GroupedLoRA, attach_any, expert_layers, linear_targets
from glm5_mcore.lora.layers import LoRALayer
from glm5_mcore.model.dsa import GLM5SparseAttention
from glm5_mcore.model.indexer_stages import set_indexer_frozen
from glm5_mcore.model.parallel import rank_offsets
from glm5_mcore.switches import switched

# --------------------------------------------------------------------------------------------------
# Model-level API
# --------------------------------------------------------------------------------------------------
def lora_layers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, LoRALayer]]:
    """(module path, base module, its LoRALayer) for every adapted linear (each expert of a grouped linear:
    ``lora.grouped.ExpertSlot``)."""
    for name, mod in model.named_modules():
        lora = getattr(mod, "lora", None)
        if isinstance(lora, LoRALayer):
            yield name, mod, lora
        elif isinstance(lora, GroupedLoRA):
            yield from expert_layers(name, mod)


def global_module_name(name: str, layer_offset: int, expert_offset: int) -> str:
    """A module path with this rank's pipeline layer and EP expert indices made global, so adapters
    are named (and seeded) the same under every layout."""
    name = re.sub(r"(^|\.)decoder\.layers\.(\d+)\.",
                  lambda m: f"{m.group(1)}decoder.layers.{int(m.group(2)) + layer_offset}.", name)
    return re.sub(r"\.local_experts\.(\d+)\.", lambda m: f".local_experts.{int(m.group(1)) + expert_offset}.", name)


def _indexer_frozen(model) -> bool:
    params = [p for m in model.modules() if isinstance(m, GLM5SparseAttention) and m.indexer is not None
              for p in m.indexer.parameters()]
    return bool(params) and not any(p.requires_grad for p in params)


def apply_lora(model: torch.nn.Module, cfg: LoRAConfig, adapter_name: str = "default",
               freeze_base: bool = True, freeze_indexer: bool = True) -> int:
    """Add adapter ``adapter_name`` to every linear of ``cfg.targets``; returns #adapted modules.

    Base weights are frozen (``freeze_base``) and so is the whole indexer (``freeze_indexer``, the
    default; no grads, hence no optimizer state). Indexer adapters train only with the indexer loss
    (the LM loss does not reach the indexer), so targeting the indexer while it is frozen is an error.
    """
    cfg.validate()
    wants_indexer = any(t in INDEXER for t in cfg.targets)
    if wants_indexer and (freeze_indexer or _indexer_frozen(model)):
        raise ValueError(f"LoRA targets {[t for t in cfg.targets if t in INDEXER]} are indexer linears, but the "
                         "indexer is frozen: its adapters would get no gradient (pass freeze_indexer=False "
                         "and train them with the indexer loss)")
    if freeze_base:
        for n, p in model.named_parameters():
            if ".lora." not in f".{n}":
                p.requires_grad_(False)
    *_, layer_offset, expert_offset = rank_offsets(model)
    n_added = 0
    for name, mod in linear_targets(model):
        fam = family_of(name)
        if fam is None or fam not in cfg.targets or not isinstance(getattr(mod, "weight", None), torch.Tensor):
            continue
        lora = attach_any(mod, global_module_name(name, layer_offset, expert_offset), fam)
        lora.add(adapter_name, cfg.rank_for(fam), cfg.alpha_for(fam), cfg.dropout, cfg.init, cfg.seed,
                 mod.weight.dtype, mod.weight.device)
        n_added += 1
    if n_added == 0:
        raise ValueError(f"LoRA targets {list(cfg.targets)} match no module of the model")
    if freeze_indexer:
        set_indexer_frozen(model, True)
    return n_added


def set_adapter(model: torch.nn.Module, name: str) -> None:
    """Make ``name`` the active adapter everywhere it exists (layers without it run the base only)."""
    found = False
    for _, _, lora in lora_layers(model):
        lora.active = name if name in lora.A else None
        found |= name in lora.A
    if not found:
        raise ValueError(f"no LoRA adapter called {name!r} on the model")


@contextlib.contextmanager
def disable_adapters(model: torch.nn.Module):
    """Run the base model (the RL reference policy): no adapter is applied inside the block."""
    with switched((lora for _, _, lora in lora_layers(model)), "disabled", True):
        yield


@torch.no_grad()
def merge(model: torch.nn.Module, name: Optional[str] = None) -> int:
    """Fold adapter ``name`` (default: the active one) into the base weights; returns #merged."""
    n = 0
    for _, base, lora in lora_layers(model):
        adapter = name or lora.active
        if adapter is None or adapter not in lora.A or adapter in lora.merged:
            continue
        base.weight.add_(lora.local_delta_weight(adapter).to(base.weight.dtype))
        lora.merged.add(adapter)
        n += 1
    return n


@torch.no_grad()
def unmerge(model: torch.nn.Module, name: Optional[str] = None) -> int:
    """Undo ``merge``; returns #unmerged."""
    n = 0
    for _, base, lora in lora_layers(model):
        adapter = name or lora.active
        if adapter is None or adapter not in lora.merged:
            continue
        base.weight.sub_(lora.local_delta_weight(adapter).to(base.weight.dtype))
        lora.merged.discard(adapter)
        n += 1
    return n


def adapter_parameters(model: torch.nn.Module, name: Optional[str] = None) -> list[torch.nn.Parameter]:
    """The LoRA parameters of adapter ``name`` (default: all adapters)."""
    out = []
    for _, _, lora in lora_layers(model):
        for n in lora.A:
            if name is None or n == name:
                out += [lora.A[n], lora.B[n]]
    return out


def is_lora_param(param_name: str) -> bool:
    return ".lora." in f".{param_name}"

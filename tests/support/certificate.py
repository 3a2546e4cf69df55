"""The LoRA parity certificate: for each adapter family alone and all together (adapters with B != 0),
the reference's log-probs (the vLLM-CPU engine's, or transformers + PEFT's) against the trainer's on the
same tokens, and whether the family's perturbation reached the reference at all.

A row: ``mean`` / ``max`` |Δ log-prob| between trainer and reference with the family's adapter on, and
``applied``, the least-squares slope of the reference's move against the trainer's move (both measured
from the trainer's base log-probs on the same tokens):

    applied = Σ (ref − base)(ours − base) / Σ (ours − base)²

1.000 when the reference moved exactly as the trainer did; 0.000 when the family never reached it (a push
that silently dropped it: the reference stays at the base). |Δ| alone cannot catch a dropped family whose
move is small; ``applied`` can, so ``check`` needs both. Families are picked by Megatron module path, so
the dense MLP and the shared expert (both ``linear_fc1/fc2``) are separate rows.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load, save

from glm5_mcore.checkpoint.manifest import NAME as MANIFEST, write_manifest
from glm5_mcore.lora.apply import lora_layers
from glm5_mcore.lora.config import INDEXER

FAMILIES: dict[str, Callable[[str, str], bool]] = {
    "mla": lambda fam, name: fam in ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj",
                                     "linear_proj"),
    "kv_b_proj": lambda fam, name: fam == "linear_kv_up_proj",
    "indexer": lambda fam, name: fam in INDEXER,
    "dense": lambda fam, name: fam in ("linear_fc1", "linear_fc2") and ".shared_experts." not in name,
    "shared": lambda fam, name: fam in ("linear_fc1", "linear_fc2") and ".shared_experts." in name,
    "routed": lambda fam, name: fam.startswith("experts."),
}
"""Certificate family -> predicate on (LoRA family, Megatron module path)."""

HF_KEYS = {"routed": re.compile(r"\.mlp\.experts\."), "shared": re.compile(r"\.mlp\.shared_experts\."),
           "kv_b_proj": re.compile(r"\.kv_b_proj\."), "indexer": re.compile(r"\.indexer\.")}
"""Certificate family -> the PEFT adapter keys it owns (to drop it from a push, on purpose)."""

MAX_ABS = 1e-4  # fp32 on CPU; the bound
APPLIED_TOL = 0.02


@dataclass
class Row:
    family: str
    mean: float
    max: float
    applied: float
    moved: float
    """max |ours − base|: how far the family moved the trainer's log-probs (the slope means little if ~0)"""

    @property
    def ok(self) -> bool:
        return self.max <= MAX_ABS and (self.family == "base" or (abs(self.applied - 1.0) <= APPLIED_TOL
                                                                   and self.moved >= 100 * MAX_ABS))

    def line(self) -> str:
        applied = "-" if self.family == "base" else f"{self.applied:.3f}"
        return (f"{self.family:<16} {self.mean:8.2e} {self.max:8.2e} {applied:>7} {self.moved:8.2e} "
                f"{'ok' if self.ok else 'FAIL'}")


def randomize_adapters(model, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """B of every adapter (``default``) set random, non-zero; returns {module path: B} to restore from."""
    g = torch.Generator().manual_seed(seed)
    saved = {}
    with torch.no_grad():
        for _, _, lora in lora_layers(model):
            b = lora.B["default"]
            b.copy_(torch.randn(b.shape, generator=g) * scale)
            saved[lora.module_name] = b.detach().clone()
    return saved


def keep_families(model, saved: dict[str, torch.Tensor], families) -> int:
    """Adapters of ``families`` (``FAMILIES`` keys) back at their ``saved`` B, every other B zero (a no-op);
    returns #adapters kept (an error if none: the family is not on this model)."""
    kept = 0
    with torch.no_grad():
        for _, _, lora in lora_layers(model):
            on = any(FAMILIES[f](lora.family, lora.module_name) for f in families)
            lora.B["default"].copy_(saved[lora.module_name] if on else torch.zeros_like(saved[lora.module_name]))
            kept += on
    assert kept, f"no adapter of {list(families)} on the model"
    return kept


def drop_from_adapter(files: dict, family: str) -> dict:
    """A PEFT payload's files (name -> bytes) without ``family``'s tensors, its manifest rewritten to match (a
    push that drops the family silently: nothing downstream can tell from the files)."""
    tensors = load(files["adapter_model.safetensors"])
    kept = {k: v for k, v in tensors.items() if not HF_KEYS[family].search(k)}
    assert len(kept) < len(tensors), f"no {family} tensor in the adapter"
    out = {**files, "adapter_model.safetensors": save(kept)}
    if MANIFEST not in files:
        return out
    with tempfile.TemporaryDirectory() as d:
        for name, data in out.items():
            if name != MANIFEST:
                (Path(d) / name).write_bytes(data)
        out[MANIFEST] = write_manifest(d).read_bytes()
    return out


def row(family: str, ours: torch.Tensor, ref: torch.Tensor, base: torch.Tensor) -> Row:
    """One certificate row from flat per-token log-probs [N]: trainer ``ours``, reference ``ref``, trainer
    base ``base`` (adapters off) on the same tokens."""
    ours, ref, base = (t.double().flatten() for t in (ours, ref, base))
    d = (ours - ref).abs()
    move = ours - base
    applied = float(((ref - base) * move).sum() / (move * move).sum().clamp_min(1e-30))
    return Row(family, float(d.mean()), float(d.max()), applied, float(move.abs().max()))


def table(rows: list[Row]) -> str:
    return "\n".join([f"{'family':<16} {'mean|Δ|':>8} {'max|Δ|':>8} {'applied':>7} {'moved':>8}", *(r.line() for r in rows)])


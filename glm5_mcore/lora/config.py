"""What a LoRA adapter is, before any model: the GLM-5 linear families it may target (Megatron names), and
``LoRAConfig`` (rank, alpha, dropout, targets, init, per-family overrides, seed). The planner and the config
schema need only this module."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


MLA = ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj")


MLP = ("linear_fc1", "linear_fc2")


EXPERTS = ("experts.linear_fc1", "experts.linear_fc2")


INDEXER = ("linear_wq_b", "linear_wk", "linear_weights_proj")


FAMILIES = MLA + MLP + EXPERTS + INDEXER


DEFAULT_TARGETS = MLA + MLP


VLLM_LORA = ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_proj") + MLP + EXPERTS + (
    "linear_wq_b",)
"""The families vLLM 0.32 serves as a LoRA adapter (``rl.rollout.vllm_lora``); it merges the others
(``linear_kv_up_proj``: its MLA decodes with ``W_UK`` / ``W_UV``; the indexer's ``linear_wk`` /
``linear_weights_proj``: fused into one module no LoRA layer wraps)."""


@dataclass
class LoRAConfig:
    """Adapter hyper-parameters. ``scale = alpha / rank`` (as ``peft`` without rsLoRA)."""

    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    targets: tuple[str, ...] = DEFAULT_TARGETS
    init: str = "kaiming"
    """"kaiming": A kaiming-uniform, B zero (``peft``'s default, the adapter starts as a no-op);
    "gaussian": A normal(1/rank), B zero; "random": A and B both random (tests, never training)."""
    rank_overrides: dict[str, int] = field(default_factory=dict)
    alpha_overrides: dict[str, float] = field(default_factory=dict)
    seed: int = 0

    def validate(self) -> None:
        unknown = [t for t in (*self.targets, *self.rank_overrides, *self.alpha_overrides) if t not in FAMILIES]
        if unknown:
            raise ValueError(f"LoRA targets: unknown name(s) {unknown}; known: {list(FAMILIES)}")
        if self.init not in ("kaiming", "gaussian", "random"):
            raise ValueError(f"LoRA init: {self.init!r} is not one of kaiming, gaussian, random")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout: {self.dropout} is not in [0, 1)")
        for fam in self.targets:
            if self.rank_for(fam) < 1:
                raise ValueError(f"LoRA rank for {fam}: {self.rank_for(fam)} < 1")

    def rank_for(self, family: str) -> int:
        return int(self.rank_overrides.get(family, self.rank))

    def alpha_for(self, family: str) -> float:
        return float(self.alpha_overrides.get(family, self.alpha))


def family_of(module_name: str) -> Optional[str]:
    """The LoRA family of a Megatron module path, or None if it is not a targetable linear."""
    last = module_name.rsplit(".", 1)[-1]
    routed = ".experts.local_experts." in f".{module_name}" or f".{module_name}".endswith(
        (".mlp.experts.linear_fc1", ".mlp.experts.linear_fc2"))  # SequentialMLP / TEGroupedMLP
    if routed and last in ("linear_fc1", "linear_fc2"):
        return f"experts.{last}"
    if ".core_attention.indexer." in module_name and last in INDEXER:
        return last
    if last in MLA or last in MLP:
        return last
    return None


def routed_expert_targets(targets) -> list[str]:
    """The targets of ``targets`` that adapt the routed experts (``experts.linear_fc1/2``), sorted."""
    return sorted(str(t) for t in targets if str(t).startswith("experts."))


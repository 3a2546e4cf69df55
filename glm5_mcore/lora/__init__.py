"""LoRA adapters: ``LoRAConfig`` (``lora.config``), attached and switched on a model (``lora.apply``).
Only this package's names."""

from glm5_mcore.lora.apply import apply_lora, disable_adapters, merge, set_adapter, unmerge
from glm5_mcore.lora.config import LoRAConfig

__all__ = ["LoRAConfig", "apply_lora", "disable_adapters", "merge", "set_adapter", "unmerge"]

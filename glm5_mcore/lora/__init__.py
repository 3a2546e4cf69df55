"""LoRA adapters: ``LoRAConfig`` and the families (``lora.config``), the TP-correct layer (``lora.layers``),
attached and switched on a model (``lora.apply``), adapter state and formats (``state``, ``peft``,
``bridge_peft``).

Nothing is re-exported here: ``lora.config`` is what the config schemas and the planner import (``glm5 sft
--help``, ``glm5 plan`` stay free of Megatron-Core); a package face would load ``lora.apply`` and the model."""

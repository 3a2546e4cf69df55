"""LoRA adapters."""

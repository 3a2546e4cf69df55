"""The streaming HF <-> Megatron converters."""

"""The network on Megatron-Core specs."""

"""GRPO / PPO for GLM-5 LoRA on Megatron-Core, orchestrated by Ray (see ``rl.driver``)."""

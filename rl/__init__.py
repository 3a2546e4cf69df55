"""GRPO / PPO for GLM-5 LoRA on Megatron-Core, orchestrated by Ray.

The folder is the architecture; imports go down this list, never up:

- ``driver`` (the loop), ``validate`` (refusals before Ray), ``config`` (the run's schema, read by all);
- ``schedule/``: where a step's samples come from (sync, one-step-off, async, colocated phases);
- ``cluster/``: Ray start-up, the trainer ranks' and the rollout engines' actors;
- ``train/``: what runs on a trainer rank (the Megatron-Core policy, verl's math, micro-batches, R3, CP, MTP);
- ``tasks/``: prompt sets, rewards, tool episodes, the sandbox (nothing of the trainer or the schedule);
- ``rollout/``: the engines behind one interface, token ids in, ids and log-probs out.
"""

"""What runs on a trainer rank: the Megatron-Core policy (and critic) with their LoRA adapters, verl's RL
math on the rollout batch, micro-batch packing, context parallelism, R3 replay, the MTP head and the
memory handed to a colocated engine. Nothing here knows of Ray, the schedule or the driver."""

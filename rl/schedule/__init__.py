"""Where a step's samples come from: synchronous and one-step-off steps (``step_source``), fully
asynchronous rollouts with partial rollouts (``async_source``), DAPO's dynamic sampling (``shaping``) and the
colocated phases that time-share the trainer's GPUs with the engines (``colocate``)."""

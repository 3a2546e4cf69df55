"""The task: prompt sets (``datasets``, ``prompts``), reward functions and the worker pool that runs them
(``rewards``, ``step_rewards``, ``proc_pool``), multi-turn tool episodes and their environments (``episodes``,
``envs``, ``code_env``), the Python sandbox and the tool-call parser. Nothing here knows of the trainer, the schedule
or the driver."""

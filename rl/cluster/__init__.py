"""The Ray cluster: start-up, resource checks and waits (``ray_jobs``), the trainer ranks' actors in their
placement group and the rollout engines' actors (``workers``)."""

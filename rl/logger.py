"""The RL driver's console keys: what its progress bar (``glm5_mcore.training.run_log.RunLogger``) shows of
each step's metrics, as ``(short name, metric key)``."""

CONSOLE_KEYS = (("reward", "critic/score/mean"), ("val", "val/reward"), ("len", "response_length/mean"),
                ("pg", "actor/pg_loss"), ("clip", "actor/pg_clipfrac"), ("ent", "actor/entropy"),
                ("kl", "actor/ref_kl"), ("k3", "rollout_corr/k3_kl"), ("masked", "rollout_corr/rollout_is_oob_ratio"),
                ("vf", "critic/vf_loss"), ("moe", "moe/max_over_mean"), ("s", "timing_s/step"))

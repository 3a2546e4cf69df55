"""Megatron-Core's activation checkpointing (``tensor_parallel.checkpoint``, the engine of
``recompute_granularity`` full and selective) with the CPU's RNG state.

Answers: ``CheckpointFunction.forward`` (tensor_parallel/random.py:604) and ``CheckpointWithoutOutput.checkpoint``
(random.py:762) save ``_get_all_rng_states()`` (random.py:525), which reads the CUDA generator
(random.py:528 → ``torch.cuda.random.get_rng_state`` at random.py:118: "Torch not compiled with CUDA enabled"),
and the recompute restores it with ``_set_all_rng_states`` (random.py:535), whose ``_set_cuda_rng_state``
(random.py:538 → random.py:175) queues a ``torch.cuda._lazy_call`` that never runs on a CPU and is kept for
ever. On the CPU every draw (LoRA dropout, any ``torch.rand``) comes from the CPU generator, which those same
functions already save and restore first (random.py:527, :537), and Megatron's tracker states (the
model-parallel / expert streams); the replacements keep exactly those two, so a recomputed region draws the
numbers its forward drew and the stream after the backward is the one without recompute.
"""

from __future__ import annotations

import torch


def checkpoint_rng_on_cpu() -> None:
    """Re-bind random.py's ``_get_all_rng_states`` / ``_set_all_rng_states`` (looked up by name when
    ``CheckpointFunction``, ``CheckpointWithoutOutput`` and ``_fork_rng`` run) to the CPU generator and
    Megatron's tracker; the CUDA slot of the saved triple is None."""
    from megatron.core.tensor_parallel import random as mrandom

    def get_all_rng_states():
        return torch.get_rng_state(), None, mrandom.get_cuda_rng_tracker().get_states()

    def set_all_rng_states(cpu_rng_state, _cuda_rng_state, cuda_rng_state_tracker):
        torch.set_rng_state(cpu_rng_state)
        mrandom.get_cuda_rng_tracker().set_states(cuda_rng_state_tracker)

    mrandom._get_all_rng_states = get_all_rng_states
    mrandom._set_all_rng_states = set_all_rng_states

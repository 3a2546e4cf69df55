"""The training device: one answer to "where do this rank's tensors live", used by the model build,
the SFT and RL data paths, the rollout engine and every collective's tensors.

CUDA's current device under CUDA (set per rank by ``init_parallel`` from ``LOCAL_RANK``), else the
CPU. Tests override it (``training_device_override``) with a stand-in accelerator so that a tensor
created on the CPU where the device was meant fails on a CPU-only machine as it would on CUDA.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from typing import Optional

import torch

_override: Optional[torch.device] = None


def training_device() -> torch.device:
    """Where parameters, batches and collective buffers of this rank live."""
    if _override is not None:
        return _override
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@contextlib.contextmanager
def training_device_override(device: torch.device | str):
    """Tests: ``training_device()`` returns ``device`` while active."""
    global _override
    prev, _override = _override, torch.device(device)
    try:
        yield _override
    finally:
        _override = prev


def dist_timeout() -> datetime.timedelta:
    """The timeout of every process group this project creates: ``GLM5_DIST_TIMEOUT_MINUTES`` (default 30;
    Megatron-LM's ``--distributed-timeout-minutes``). PyTorch's NCCL default is 10 minutes, which a
    744B checkpoint's verification or load on a shared file system can outlast."""
    raw = os.environ.get("GLM5_DIST_TIMEOUT_MINUTES", "30")
    try:
        minutes = float(raw)
    except ValueError:
        raise ValueError(f"GLM5_DIST_TIMEOUT_MINUTES={raw!r}: a number of minutes") from None
    if minutes <= 0:
        raise ValueError(f"GLM5_DIST_TIMEOUT_MINUTES={raw!r}: must be > 0")
    return datetime.timedelta(minutes=minutes)

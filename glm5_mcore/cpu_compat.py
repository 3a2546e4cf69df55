"""Everything Megatron-Core 0.19.2 needs to run on a CPU, in one place.

Each workaround is named after the wall it answers (file:line in megatron-core 0.19.2) so it can be
deleted when upstream is fixed. ``apply()`` installs the runtime patches only when CUDA is absent;
on a CUDA machine it does nothing. ``LocalBackend`` fills the gaps of Megatron-Core's local
(non-Transformer-Engine) backend, which is the backend used on CPU.
"""

from __future__ import annotations

import functools

import torch
from megatron.core.models.backends import LocalSpecProvider

_applied = False


# --------------------------------------------------------------------------------------------------
# Local backend gaps
# --------------------------------------------------------------------------------------------------
class TorchNorm:
    """torch ``RMSNorm`` / ``LayerNorm`` that also works under sequence parallelism.

    Answers: ``WrappedTorchNorm`` asserts ``not config.sequence_parallel``
    (transformer/torch_norm.py:50), yet SP is mandatory for TP > 1 with MoE (moe/moe_layer.py:630).
    A norm is per token, so SP only needs its weight gradients summed over TP: the params are
    tagged ``sequence_parallel`` for Megatron's grad finalisation.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        if config.normalization == "RMSNorm":
            norm = torch.nn.RMSNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        else:
            norm = torch.nn.LayerNorm(hidden_size, eps=eps, dtype=config.params_dtype)
        for p in norm.parameters():
            setattr(p, "sequence_parallel", bool(config.sequence_parallel))
        return norm


class LocalBackend(LocalSpecProvider):
    """Megatron-Core's local backend plus ``linear()`` and an SP-capable torch norm.

    ``linear()`` answers: ``LocalSpecProvider`` has none (models/backends.py:99), which the DSA
    indexer needs; Megatron-Core's own replicated ``Linear`` (post_training/modelopt/layers.py:105)
    takes ``parallel_mode="duplicated"``.
    """

    def linear(self) -> type:
        from megatron.core.post_training.modelopt.layers import Linear

        return Linear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False, has_residual: bool = False) -> type:
        return TorchNorm


# --------------------------------------------------------------------------------------------------
# Runtime patches (CPU only)
# --------------------------------------------------------------------------------------------------
def _cpu_device_as_current_device() -> None:
    """``torch.cuda.current_device()`` used as a tensor device: rotary_pos_embedding.py:78,162,
    moe/router.py:98,184, multi_token_prediction.py:192,374, dsa.py:300. On CPU it names the CPU."""
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]


def _no_pin_memory() -> None:
    """rope_utils.py:62 builds CP position tensors with ``pin_memory=True`` (needs CUDA)."""
    import megatron.core.models.common.embeddings.rope_utils as rope_utils

    real = torch.tensor

    @functools.wraps(real)
    def tensor(*args, pin_memory=False, **kwargs):
        return real(*args, **kwargs)

    class _TorchProxy:
        def __getattr__(self, name):
            return tensor if name == "tensor" else getattr(torch, name)

    rope_utils.torch = _TorchProxy()


def _disable_torch_compile_jit() -> None:
    """jit.py: ``jit_fuser`` is ``torch.compile``, ~20 s cold per fused function on CPU."""
    import torch._dynamo

    torch._dynamo.config.disable = True


def apply() -> None:
    """Install the CPU workarounds once; a no-op when CUDA is available."""
    global _applied
    if _applied or torch.cuda.is_available():
        return
    _cpu_device_as_current_device()
    _no_pin_memory()
    _disable_torch_compile_jit()
    _applied = True

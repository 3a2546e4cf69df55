"""Value checks shared by every reader and writer of weights: a NaN/Inf tensor is an error naming the
tensor and its file (``check_finite``), and a PyTorch-DCP failure becomes one line (``short_error``)."""

from __future__ import annotations

import torch


class NonFiniteError(ValueError):
    """A weight holds NaN or Inf; the message names the tensor and its file."""


def check_finite(t: torch.Tensor, name: str, where) -> None:
    """Raise ``NonFiniteError`` naming ``name`` (in ``where``) if ``t`` has NaN/Inf values."""
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        bad = int((~torch.isfinite(t)).sum())
        raise NonFiniteError(f"{where}: tensor {name} has {bad} non-finite value(s) (NaN/Inf); "
                             "--allow-nonfinite converts it anyway")


def check_finite_fp8(q: torch.Tensor, scale: torch.Tensor, name: str, where) -> None:
    """``check_finite`` of an FP8 weight as stored: its e4m3 bytes (``float8_e4m3fn`` has NaN, no Inf: the
    codes with all exponent and mantissa bits set) and its block scales, without dequantizing it."""
    bad = int(((q.view(torch.uint8) & 0x7F) == 0x7F).sum())
    if bad:
        raise NonFiniteError(f"{where}: tensor {name} has {bad} non-finite value(s) (NaN/Inf); "
                             "--allow-nonfinite converts it anyway")
    check_finite(scale, f"{name}_scale_inv", where)


def short_error(e: BaseException) -> str:
    """One line for a (PyTorch-DCP) load error: the first underlying exception's type and message,
    not the traceback text a ``CheckpointException`` embeds."""
    for f in getattr(e, "failures", {}).values():
        inner = getattr(f, "exc", None) or (f[0] if isinstance(f, tuple) and f else None)
        if isinstance(inner, BaseException):
            e = inner
            break
    msg = " ".join(str(e).split())
    return f"{type(e).__name__}: {msg[:300]}"

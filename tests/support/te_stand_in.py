"""Stand-ins for Transformer Engine on a machine without it (the note ``gpu-path-review-4.md`` names where each
is faithful):

- ``te_version``: Megatron-Core's TE version checks answer as under TE 2.14 (the newest it tests for), so an FP8
  TE ``TransformerConfig`` (``fp8="e4m3"``, ``fp8_recipe="blockwise"``, ``fp8_param``) builds on the CPU
  (``transformer_config.py``: "Only transformer-engine>=1.7.0 supports MoE FP8 training").
- ``FakeQuantizer`` / ``FakeTEWeight``: a ``Float8BlockwiseQTensor``'s storage rules (TE ``module/base.py``
  ``reset_parameters``; ``float8_blockwise_tensor_storage.py`` ``update_usage``): row-wise e4m3 data + scales, a
  column-wise copy made (new tensors) when asked and set to None when dropped, the weight's own quantizer whose
  ``columnwise_usage`` TE's forward reads (``linear.py`` ``get_weight_workspace``), and
  ``_high_precision_init_val``.
- ``FakeTELinear``: a linear whose init follows TE's under ``fp8_model_init`` (the quantizer's column-wise usage
  and Megatron-Core's ``preserve_high_precision_init_val`` both ``torch.is_grad_enabled()``), whose forward makes
  the column-wise copy when the weight's quantizer asks for it and whose backward always does (``linear.py``
  dgrad), as TE v2.14's ``Linear`` does for an FP8 primary weight.
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def te_version(version: str = "2.14.0"):
    from packaging.version import Version

    import megatron.core.transformer.transformer_config as tc

    real = tc.is_te_min_version, tc.get_te_version
    tc.is_te_min_version = lambda v, check_equality=True: Version(version) >= Version(v)
    tc.get_te_version = lambda: Version(version)
    try:
        yield
    finally:
        tc.is_te_min_version, tc.get_te_version = real


class FakeQuantizer:
    def __init__(self):
        self.rowwise_usage, self.columnwise_usage = True, True

    def set_usage(self, rowwise=None, columnwise=None):
        if rowwise is not None:
            self.rowwise_usage = rowwise
        if columnwise is not None:
            self.columnwise_usage = columnwise


class FakeTEWeight(torch.nn.Parameter):
    """A frozen FP8 primary weight [M, N] as TE stores it: ``_rowwise_data`` uint8 [M, N], ``_rowwise_scale_inv``
    fp32 per 128x128 block; ``_columnwise_data`` [N, M] and its scales while the column-wise usage is on."""

    def __new__(cls, M: int, N: int, columnwise: bool):
        # the logical shape [M, N] over one element (TE's reports it without a dense copy)
        self = super().__new__(cls, torch.zeros(1, dtype=torch.bfloat16).expand(M, N), requires_grad=False)
        self._rowwise_data = torch.randint(0, 255, (M, N), dtype=torch.uint8)
        self._rowwise_scale_inv = torch.rand(-(-M // 128), -(-N // 128))
        self._columnwise_data = self._columnwise_scale_inv = None
        self._quantizer = FakeQuantizer()
        self.logical_shape = (M, N)
        if columnwise:
            self._create_columnwise()
        return self

    def _create_columnwise(self):  # TE makes new tensors (fp8_transpose(out=None))
        self._columnwise_data = self._rowwise_data.t().contiguous()
        self._columnwise_scale_inv = self._rowwise_scale_inv.t().contiguous()

    def update_usage(self, rowwise_usage=None, columnwise_usage=None):
        if columnwise_usage is True and self._columnwise_data is None:
            self._create_columnwise()
        elif columnwise_usage is False:
            self._columnwise_data = self._columnwise_scale_inv = None


class FakeTELinear(torch.nn.Module):
    """See the module docstring. ``forward(x)`` returns ``x`` scaled (the values do not matter here)."""

    def __init__(self, M: int, N: int):
        super().__init__()
        grad = torch.is_grad_enabled()
        w = FakeTEWeight(M, N, columnwise=grad)
        w._quantizer.set_usage(rowwise=True, columnwise=grad)
        if grad:  # Megatron-Core: preserve_high_precision_init_val=torch.is_grad_enabled()
            w._high_precision_init_val = torch.zeros(M, N, dtype=torch.bfloat16)
            w.clear_high_precision_init_val = lambda w=w: w.__dict__.pop("_high_precision_init_val", None)
        self.weight = w

    def forward(self, x):
        w = self.weight
        if w._quantizer.columnwise_usage:  # get_weight_workspace for an already-quantized weight
            w.update_usage(rowwise_usage=True, columnwise_usage=True)
        return _Backward.apply(x, self)


class _Backward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mod):
        ctx.mod = mod
        return x * 2

    @staticmethod
    def backward(ctx, g):
        ctx.mod.weight.update_usage(columnwise_usage=True)  # linear.py dgrad: weight_fp8.update_usage(columnwise=True)
        ctx.mod.bytes_in_dgrad = sum(t.numel() * t.element_size() for t in (
            ctx.mod.weight._rowwise_data, ctx.mod.weight._rowwise_scale_inv, ctx.mod.weight._columnwise_data,
            ctx.mod.weight._columnwise_scale_inv) if t is not None)
        return g * 2, None

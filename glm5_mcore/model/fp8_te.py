"""The FP8 base on Transformer Engine (``model.base_dtype=fp8`` with ``trainer.backend=te``): its Megatron-Core
settings, how its weights are built, and the rule that keeps them at 1 byte per element outside a module's backward.

A TE FP8 primary weight (``Float8BlockwiseQTensor``) holds row-wise e4m3 data + block scales (what the release
stores; ``fp8_linear.load_block_fp8_`` writes them) and, while its column-wise usage is on, a column-wise
(transposed) copy of both, which Hopper's dgrad GEMM needs: 2 bytes per element. TE turns that usage on wherever grad
is enabled: at build (``module/base.py`` ``reset_parameters``: ``set_usage(rowwise=True,
columnwise=torch.is_grad_enabled())``) and then in every forward, grad-free ones included, from the weight's own
quantizer (``module/linear.py`` ``get_weight_workspace`` → ``update_usage``; ``grouped_linear.py`` alike).
Megatron-Core also has TE keep a bf16 host copy of each weight's initial values when grad is enabled
(``fp8_utils.py`` ``preserve_high_precision_init_val=torch.is_grad_enabled()``), which only the distributed optimizer
clears, and only for the parameters it owns: never for a frozen base (2 bytes per element of host memory per rank).

So the base is built under ``te_fp8_build`` (no grad: row-wise only, no host copy), ``release_te_copies`` then sets
every frozen FP8 weight's quantizer to row-wise only (a forward no longer makes the copy) and drops what a copy or an
init value is left anyway, and ``drop_columnwise_after_backward`` frees the copy each module's backward makes just
in time (``linear.py`` dgrad: ``weight_fp8.update_usage(columnwise_usage=True)``): 1 byte per element + scales
except inside one module's backward. ``bench/gpu_check_fp8.py`` checks it on a GPU with TE.
"""

from __future__ import annotations

import torch

from glm5_mcore.model.fp8_linear import is_te_quantized


def te_fp8_overrides() -> dict:
    """Megatron-Core config for TE's blockwise FP8 with FP8 primary weights (``trainer.backend=te``)."""
    return {"fp8": "e4m3", "fp8_recipe": "blockwise", "fp8_param": True}


def te_fp8_build():
    """The context an FP8-base model is built in on TE: no grad, so TE quantizes each weight row-wise only and
    Megatron-Core keeps no high-precision host copy (the module docstring)."""
    return torch.no_grad()


def frozen_te_weights(model: torch.nn.Module):
    """The frozen TE FP8 weights of ``model`` (each once)."""
    seen = set()
    for p in model.parameters():
        if is_te_quantized(p) and not p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            yield p


def drop_columnwise(p: torch.Tensor) -> None:
    """Free a TE FP8 weight's column-wise copy (TE makes it again, exactly, from the row-wise data when asked)."""
    if getattr(p, "_rowwise_data", None) is not None and getattr(p, "_columnwise_data", None) is not None:
        p.update_usage(rowwise_usage=True, columnwise_usage=False)


def release_te_copies(model: torch.nn.Module) -> int:
    """Every frozen TE FP8 weight of ``model``: its quantizer row-wise only (TE's forward then makes no column-wise
    copy), its column-wise copy dropped, its high-precision init value cleared. Returns #weights."""
    n = 0
    for p in frozen_te_weights(model):
        q = getattr(p, "_quantizer", None)
        if q is not None:
            q.set_usage(rowwise=True, columnwise=False)
        drop_columnwise(p)
        if hasattr(p, "_high_precision_init_val"):
            p.clear_high_precision_init_val()
        n += 1
    return n


def drop_columnwise_after_backward(model: torch.nn.Module) -> int:
    """TE: free each FP8 weight's column-wise (transposed) copy when its module's backward is done, so the
    frozen base holds 1 byte per element between layers (TE makes the copy again from the row-wise data,
    exactly, in the next backward). Returns #modules hooked."""
    n = 0
    for mod in model.modules():
        ws = [p for p in mod.parameters(recurse=False) if is_te_quantized(p) and not p.requires_grad]
        if not ws:
            continue

        def drop(_m, _gi, _go, ws=ws):
            for w in ws:
                drop_columnwise(w)

        mod.register_full_backward_hook(drop)
        n += 1
    return n

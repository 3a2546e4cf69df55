"""The FP8 base on Transformer Engine holds 1 byte per element (+ block scales) outside a module's backward and no
host copy of its initial values (``glm5_mcore.model.fp8_te``), checked with stand-ins for TE's FP8 weights and
linears (``tests/support/te_stand_in.py``: TE v2.14's storage and usage rules) through ``build_model``, the load,
forward-only and training passes. On a GPU with TE: ``bench/gpu_check_fp8.py``."""

import pytest
import torch

from glm5_mcore.checkpoint.fp8 import quantize_fp8_blocks
from glm5_mcore.model.fp8_linear import load_block_fp8_, stored_bytes
from glm5_mcore.model.fp8_te import drop_columnwise_after_backward, release_te_copies
from tests.support.te_stand_in import FakeTELinear, te_version

M, N = 256, 384


def _rowwise(w) -> int:
    return w._rowwise_data.numel() + 4 * w._rowwise_scale_inv.numel()


@pytest.fixture()
def built_by_build_model(tiny_dir, single_rank, monkeypatch):
    """(the stand-in TE linear ``build_model`` built for the FP8 base with the TE backend, grad enabled then)."""
    import megatron.core.models.gpt as gpt

    from glm5_mcore.config import GLM5Config
    from glm5_mcore.mcore_settings import ParallelConfig
    from glm5_mcore.model.build import build_model

    grad = []

    class OneLinearGPT(torch.nn.Module):  # GPTModel's place: one TE FP8 linear, built where build_model builds
        def __init__(self, config, **_):
            super().__init__()
            grad.append(torch.is_grad_enabled())
            self.decoder = torch.nn.Sequential(FakeTELinear(M, N))

    monkeypatch.setattr(gpt, "GPTModel", OneLinearGPT)
    with te_version():
        m = build_model(GLM5Config.from_hf_dir(tiny_dir), ParallelConfig(), backend="te", base_fp8_block=128,
                        post_process=False)
    return m.decoder[0], grad[0]


def test_te_fp8_base_is_built_row_wise_only_without_a_host_copy(built_by_build_model):
    lin, grad = built_by_build_model
    w = lin.weight
    assert not grad  # TE quantizes row-wise only; Megatron-Core asks no high-precision init copy
    assert w._columnwise_data is None and not w._quantizer.columnwise_usage, "a column-wise copy after the build"
    assert not hasattr(w, "_high_precision_init_val"), "a bf16 host copy of the initial values after the build"
    assert stored_bytes(w) == _rowwise(w)


def _passes(lin) -> dict:
    """Bytes the weight holds after the load, after a forward-only pass (old / reference log-probs, the first pass
    of full recompute), into a training backward, inside its dgrad and after it."""
    w = lin.weight
    q, s = quantize_fp8_blocks(torch.randn(M, N, generator=torch.Generator().manual_seed(0)))
    load_block_fp8_(w, q, s, 128, "w")
    out = {"load": stored_bytes(w)}
    x = torch.randn(4, N)
    with torch.no_grad():
        lin(x)
    out["forward_only"] = stored_bytes(w)
    y = lin(x.requires_grad_())
    out["into_backward"] = stored_bytes(w)
    y.sum().backward()
    out["in_dgrad"], out["after_backward"] = lin.bytes_in_dgrad, stored_bytes(w)
    return out


def test_te_fp8_base_holds_one_byte_outside_a_modules_backward(built_by_build_model):
    """Built by ``build_model``, and built with grad on (as TE and Megatron-Core do by default) then settled by
    ``release_te_copies``: the release's row-wise bytes everywhere but inside the module's own backward, where TE
    makes the column-wise copy just in time."""
    legacy = FakeTELinear(M, N)
    assert legacy.weight._columnwise_data is not None and hasattr(legacy.weight, "_high_precision_init_val")
    assert release_te_copies(legacy) == 1 and not hasattr(legacy.weight, "_high_precision_init_val")
    drop_columnwise_after_backward(legacy)
    for lin in (built_by_build_model[0], legacy):
        release = _rowwise(lin.weight)
        got = _passes(lin)
        print(got, "release", release)
        assert got["in_dgrad"] == 2 * release  # the copy exists inside backward only
        assert {k: v for k, v in got.items() if k != "in_dgrad"} == dict.fromkeys(
            ("load", "forward_only", "into_backward", "after_backward"), release), got

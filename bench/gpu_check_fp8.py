"""``bench/gpu_check.py`` stage ``fp8_base``: the frozen FP8 base's GPU path (``model.base_dtype=fp8`` with
``trainer.backend=te``) against its CPU reference, on the GPU.

For weights in the release's format (e4m3 + fp32 128×128 ``weight_scale_inv``, ``checkpoint.fp8``) of a few
GLM-5-like shapes (one whose 576 rows end in a partial block, as ``linear_kv_down_proj``), a TE ``Linear``
built under ``fp8_model_init`` with ``Float8BlockScaling`` gets the stored bytes through
``model.fp8_linear.load_block_fp8_``; its forward and input gradient under ``fp8_autocast`` are compared with
the local spec's reference (``BlockFP8Weight``: dequantize per block, multiply in fp32) on the same GPU, both
with the input as is and with the input quantized in 1×128 groups as TE does (``emulated``). The ``Linear`` is built
and settled as ``build_model`` builds the FP8 base (``model.fp8_te``: under ``te_fp8_build``, then
``release_te_copies`` and ``drop_columnwise_after_backward``), and its bytes are checked outside backward: after the
load, after the forward (``bytes_in_backward``: what it takes into its backward) and after the backward, each the
release's row-wise bytes (``bytes_release``: e4m3 data + TE's 2-D scales, columns padded to 4), no
``_high_precision_init_val``; ``bytes_peak_in_backward`` is the column-wise copy TE's dgrad makes just in time.

``BUDGET_S`` seconds on one H200; without Transformer Engine the stage says so and passes nothing off as run.
Figures: per shape the max relative error (|y - ref| / max |ref|) against each reference; target: against the
emulated input quantization <= 2e-2 (bf16 output rounding and accumulation order), against the exact input
<= 1e-1 (what FP8 input quantization costs).
"""

from __future__ import annotations

import importlib.util
import os
import time

# TE reads it when it is imported (common/recipe/__init__.py), which gpu_check.py's env stage does before this
# stage runs: set when gpu_check.py loads this file. The release's weight scales are fp32 whatever it says.
os.environ.setdefault("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "1")

BUDGET_S = 20
SHAPES = [(512, 768), (576, 512), (1024, 256)]
"""(out, in) of the weights checked: whole blocks, a partial last row-block (kv_a's 576), a tall one."""
TOKENS = 256


def _quantize_input(x, block: int = 128):
    """x [T, K] quantized in 1×``block`` groups to e4m3 with fp32 scales (TE's activation layout), dequantized."""
    import torch

    T, K = x.shape
    g = x.float().view(T, K // block, block)
    s = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return ((g / s).to(torch.float8_e4m3fn).float() * s).view(T, K)


def stage(ctx: dict) -> dict:
    if ctx["dry_run"]:
        return {"plan": f"TE Float8BlockScaling Linear holding the release's e4m3 + 128x128 scales (load_block_fp8_) "
                        f"vs the CPU reference GEMM (BlockFP8Weight) on the GPU, shapes {SHAPES}, {TOKENS} tokens: "
                        "forward + dgrad, exact and emulated FP8 input; built as build_model does (model.fp8_te): "
                        "bytes after load, into backward and after it == the release's row-wise bytes, no "
                        "high-precision init copy; the column-wise copy's peak inside backward"}
    if ctx["device"].type != "cuda":
        return {"skipped": "needs a CUDA device"}
    if importlib.util.find_spec("transformer_engine") is None:
        return {"skipped": "needs Transformer Engine (not carried): the TE blockwise path is unchecked"}
    import torch
    import transformer_engine.pytorch as te
    from transformer_engine.common.recipe import Float8BlockScaling

    from glm5_mcore.checkpoint.fp8 import quantize_fp8_blocks
    from glm5_mcore.model.fp8_linear import BlockFP8Weight, is_te_quantized, load_block_fp8_, stored_bytes
    from glm5_mcore.model.fp8_te import drop_columnwise_after_backward, release_te_copies, te_fp8_build

    dev, recipe = ctx["device"], Float8BlockScaling()
    g = torch.Generator(device="cpu").manual_seed(0)
    out, ok = {"shapes": {}}, True
    for M, N in SHAPES:
        if time.monotonic() > ctx["deadline"] - 5:
            return {**out, "skipped": "deadline"}
        key = f"{M}x{N}"
        w = torch.randn(M, N, generator=g) / N ** 0.5
        q, s = quantize_fp8_blocks(w)
        ref_w = BlockFP8Weight(q.to(dev), s.to(dev), 128, torch.float32)
        x = torch.randn(TOKENS, N, generator=g).to(dev, torch.bfloat16)
        dy = torch.randn(TOKENS, M, generator=g).to(dev, torch.bfloat16)
        try:
            with te_fp8_build(), te.fp8_model_init(enabled=True, recipe=recipe,
                                                   preserve_high_precision_init_val=torch.is_grad_enabled()):
                lin = te.Linear(N, M, bias=False, params_dtype=torch.bfloat16, device=dev)
            lin.weight.requires_grad_(False)
            release_te_copies(lin)
            hooks = drop_columnwise_after_backward(lin)
            load_block_fp8_(lin.weight, q, s, 128, key)
            loaded = stored_bytes(lin.weight)
            seen, real = [], lin.weight.update_usage

            def spy(*a, real=real, w=lin.weight, seen=seen, **k):  # the bytes after every usage change
                out = real(*a, **k)
                seen.append(stored_bytes(w))
                return out

            lin.weight.update_usage = spy
            xin = x.clone().requires_grad_(True)
            with te.fp8_autocast(enabled=True, fp8_recipe=recipe):
                y = lin(xin)
            before = stored_bytes(lin.weight)
            y.backward(dy)
            after = stored_bytes(lin.weight)
            del lin.weight.update_usage
        except Exception as e:  # noqa: BLE001 - the finding is which shape TE refuses and why
            out["shapes"][key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            ok = False
            continue
        xe = _quantize_input(x)
        release = M * N + 4 * s.shape[0] * -(-s.shape[1] // 4) * 4  # TE pads the scales' columns to 4
        res = {"te_fp8_weight": is_te_quantized(lin.weight), "hooks": hooks, "bytes_release": release,
               "bytes_after_load": loaded, "bytes_in_backward": before, "bytes_after_drop": after,
               "bytes_peak_in_backward": max(seen, default=before),
               "high_precision_init_val": hasattr(lin.weight, "_high_precision_init_val")}
        for name, xr in (("exact", x.float()), ("emulated", xe)):
            ref = torch.mm(xr, ref_w.t())
            res[f"fwd_rel_{name}"] = float((y.float() - ref).abs().max() / ref.abs().max())
        ref_dx = torch.mm(dy.float(), ref_w)
        res["dgrad_rel_exact"] = float((xin.grad.float() - ref_dx).abs().max() / ref_dx.abs().max())
        one_byte = loaded == before == after == release and not res["high_precision_init_val"]
        good = (res["te_fp8_weight"] and one_byte and res["fwd_rel_emulated"] <= 2e-2 and res["fwd_rel_exact"] <= 1e-1
                and res["dgrad_rel_exact"] <= 1e-1)
        res["ok"] = bool(good)
        ok &= good
        out["shapes"][key] = res
    out["ok"] = ok
    out["targets"] = {"fwd_rel_emulated": "<= 2e-2", "fwd_rel_exact": "<= 1e-1", "dgrad_rel_exact": "<= 1e-1",
                      "bytes_after_load == bytes_in_backward == bytes_after_drop": "== bytes_release",
                      "high_precision_init_val": "False"}
    return out


if __name__ == "__main__":
    import argparse
    import json

    import torch

    argparse.ArgumentParser(description="bench/gpu_check.py's fp8_base stage alone (without CUDA: its plan); one "
                                        "JSON line").parse_args()
    print(json.dumps(stage({"device": torch.device("cuda"), "deadline": time.monotonic() + BUDGET_S,
                            "dry_run": not torch.cuda.is_available()})))

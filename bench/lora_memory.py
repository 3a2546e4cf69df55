"""LoRA memory for the real GLM-5 (744B) architecture, built on the meta device (no memory).

Counts, from the Megatron-Core model the project builds (TP1/EP1, MTP layer included), the trainable
parameters of a rank-16 adapter on the default targets (MLA + dense MLP + shared expert) and with the
routed experts added, next to full fine-tuning, and the bytes each needs for weights, gradients and
Adam state (Megatron mixed precision: bf16 weights, fp32 main grads, fp32 master copy + 2 moments).
The adapter shapes come from the same code that builds real adapters (``lora.family_of``,
``LoRALayer``'s parallel-layout rules), without allocating them.

Usage: .venv/bin/python bench/lora_memory.py [--rank 16]
"""

from __future__ import annotations

import argparse
import json
import time

BYTES_WEIGHT, BYTES_GRAD, BYTES_ADAM = 2, 4, 12  # bf16 param; fp32 main_grad; fp32 master + m + v


def count(model, targets: tuple[str, ...], rank: int) -> tuple[int, int]:
    """(#adapter params, #adapted modules) if ``targets`` got rank-``rank`` LoRA."""
    import torch

    from glm5_mcore.lora.layers import full_features, parallel_of
    from glm5_mcore.lora.config import family_of

    n = mods = 0
    for name, mod in model.named_modules():
        fam = family_of(name)
        if fam is None or fam not in targets or not isinstance(getattr(mod, "weight", None), torch.Tensor):
            continue
        in_f, out_f = full_features(mod, parallel_of(mod))
        n += rank * (in_f + out_f)
        mods += 1
    return n, mods


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, default=16)
    a = p.parse_args()
    import torch

    from glm5_mcore.config import glm5_744b
    from glm5_mcore.convert.common import meta_model
    from glm5_mcore.lora.config import DEFAULT_TARGETS, EXPERTS

    t0 = time.perf_counter()
    model = meta_model(glm5_744b(), torch.bfloat16)
    build_s = time.perf_counter() - t0
    total = sum(p.numel() for p in model.parameters())
    rows = []
    print(f"GLM-5 744B on the meta device: {total / 1e9:.1f}B parameters incl. the MTP layer (built in {build_s:.0f}s), "
          f"LoRA rank {a.rank}")
    print(f"{'setup':<28} {'trainable':>14} {'% of model':>11} {'modules':>8} {'weights GB':>11} "
          f"{'grads GB':>9} {'Adam GB':>9}")
    setups = [("LoRA default targets", DEFAULT_TARGETS), ("LoRA + routed experts", DEFAULT_TARGETS + EXPERTS)]
    for label, targets in setups:
        n, mods = count(model, targets, a.rank)
        rows.append({"setup": label, "trainable": n, "fraction": n / total, "modules": mods,
                     "adapter_weight_bytes": n * BYTES_WEIGHT, "grad_bytes": n * BYTES_GRAD,
                     "optimizer_bytes": n * BYTES_ADAM})
    rows.append({"setup": "full fine-tuning", "trainable": total, "fraction": 1.0, "modules": None,
                 "adapter_weight_bytes": 0, "grad_bytes": total * BYTES_GRAD, "optimizer_bytes": total * BYTES_ADAM})
    for r in rows:
        print(f"{r['setup']:<28} {r['trainable'] / 1e6:12.1f}M {100 * r['fraction']:10.4f}% "
              f"{r['modules'] if r['modules'] is not None else '-':>8} {r['adapter_weight_bytes'] / 1e9:11.2f} "
              f"{r['grad_bytes'] / 1e9:9.2f} {r['optimizer_bytes'] / 1e9:9.2f}")
    print(f"base weights (bf16, frozen): {total * BYTES_WEIGHT / 1e9:.0f} GB in every setup")
    out = {"model_params": total, "rank": a.rank, "rows": rows, "target_default_fraction_max": 0.001,
           "pass": rows[0]["fraction"] < 0.001}
    print(json.dumps(out))


if __name__ == "__main__":
    main()

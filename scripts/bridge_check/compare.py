"""Figures of the Bridge round trip (run.sh): HF tensors vs the source, adapters vs Bridge's, peft checks. One JSON line."""
import json
import sys

import torch

from glm5_mcore.checkpoint.hf_io import HFCheckpoint


def hf_diff(a_dir, b_dir) -> dict:
    a, b = HFCheckpoint(a_dir), HFCheckpoint(b_dir)
    common = sorted(set(a.keys()) & set(b.keys()))
    exact = sum(torch.equal(a.get(k).float(), b.get(k).float()) for k in common)
    worst = max((a.get(k).float() - b.get(k).float()).abs().max().item() for k in common)
    return {"source": len(a.keys()), "written": len(b.keys()), "common": len(common), "bit_exact": exact,
            "max_abs": worst}


def main(w: str) -> None:
    from glm5_mcore.lora.bridge_peft import read_bridge_adapter
    from glm5_mcore.parity import load_input_ids

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[2] / "tests"))
    from test_peft import _peft_model
    from transformers import AutoModelForCausalLM

    out = {"bridge_reads_ours": hf_diff(f"{w}/tiny", f"{w}/bridge_hf"),
           "we_read_bridges": hf_diff(f"{w}/tiny", f"{w}/ours_from_bridge")}
    src = torch.load(f"{w}/bridge_lora/adapters.pt")
    fa = read_bridge_adapter(f"{w}/bridge_lora")
    mods = {k[: -len(".adapter.linear_in.weight")] for k in src if k.endswith("linear_in.weight")}
    out["adapter"] = {"bridge_modules": len(mods), "read": len(fa.state.modules()),
                      "same_names": mods == set(fa.state.modules()), "scales": sorted(set(fa.state.scale.values())),
                      "max_abs": max(max((fa.state.A[m] - src[m + ".adapter.linear_in.weight"]).abs().max().item(),
                                         (fa.state.B[m] - src[m + ".adapter.linear_out.weight"]).abs().max().item())
                                     for m in mods)}
    ids = load_input_ids(None, 128, 2, 24, seed=6)
    ours, unexpected, missing = _peft_model(f"{w}/tiny", f"{w}/ours_peft")
    theirs, t_unexpected, t_missing = _peft_model(f"{w}/tiny", f"{w}/bridge_lora_hfpeft")
    merged = AutoModelForCausalLM.from_pretrained(f"{w}/ours_merged", dtype=torch.float32).eval()
    with torch.no_grad():
        lo, lt, lm = ours(ids).logits, theirs(ids).logits, merged(ids).logits
    out["peft"] = {"ours_unexpected": len(unexpected), "ours_missing": len(missing),
                   "bridge_hf_export_unexpected": len(t_unexpected), "bridge_hf_export_missing": len(t_missing),
                   "merged_vs_ours_peft_max_abs": (lm - lo).abs().max().item(),
                   "bridge_hf_export_vs_ours_peft_max_abs": (lt - lo).abs().max().item()}
    out["canonical"] = canonical(w, ids, _peft_model, AutoModelForCausalLM)
    print(json.dumps(out))


def canonical(w: str, ids, peft_model, auto) -> dict:
    """CanonicalLoRA: each module's ``scale·B·A`` we read vs Bridge's (gate rows, then up rows)."""
    from glm5_mcore.lora.bridge_peft import read_bridge_adapter

    src = torch.load(f"{w}/bridge_clora/adapters.pt")
    fa = read_bridge_adapter(f"{w}/bridge_clora")
    worst, mods = 0.0, sorted({k.split(".adapter.")[0] for k in src})
    for m in mods:
        halves = [h for h in ("adapter_gate", "adapter_up") if f"{m}.adapter.{h}.linear_in.weight" in src] or [None]
        want = torch.cat([2.0 * src[f"{m}.adapter.{h + '.' if h else ''}linear_out.weight"]
                          @ src[f"{m}.adapter.{h + '.' if h else ''}linear_in.weight"] for h in halves])
        worst = max(worst, (fa.state.delta(m) - want).abs().max().item())
    pm, unexpected, missing = peft_model(f"{w}/tiny", f"{w}/ours_cpeft")
    merged = auto.from_pretrained(f"{w}/ours_cmerged", dtype=torch.float32).eval()
    with torch.no_grad():
        d = (merged(ids).logits - pm(ids).logits).abs().max().item()
    return {"bridge_modules": len(mods), "read": len(fa.state.modules()), "delta_max_abs": worst,
            "peft_unexpected": len(unexpected), "peft_missing": len(missing), "merged_vs_peft_max_abs": d}


if __name__ == "__main__":
    main(sys.argv[1])

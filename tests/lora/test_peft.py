"""LoRA adapters exchange with HF PEFT: our export loads in peft with no missing/unexpected keys and
gives our logits; merged export too; adapters made with peft import and match."""

import json

import pytest
import torch
from safetensors.torch import save_file

from glm5_mcore.mcore_settings import ParallelConfig
from glm5_mcore.lora.config import EXPERTS, INDEXER, MLA, MLP, LoRAConfig
from glm5_mcore.lora.apply import apply_lora
from glm5_mcore.model.build import forward_logits
from glm5_mcore.parity import load_input_ids

from tests.support.helpers import hf_model, peft_model
from tests.support.launch import glm5

ALL = MLA + MLP + EXPERTS + INDEXER


def _ours(hf_dir, cfg, name="default", freeze_indexer=False):
    m, glm5 = hf_model(hf_dir)
    apply_lora(m, cfg, name, freeze_indexer=freeze_indexer)
    return m.eval(), glm5


@pytest.fixture(scope="module")
def lora_ckpt(tiny_share_dir, tmp_path_factory):
    """A checkpoint (base + adapter 'sft') of the IndexShare tiny model with every family adapted."""
    from glm5_mcore.training.checkpointing import save_checkpoint
    from glm5_mcore.checkpoint.layout import write_hf_meta
    from glm5_mcore.model.parallel import init_parallel

    init_parallel(ParallelConfig())
    cfg = LoRAConfig(rank=4, alpha=8, targets=ALL, init="random", rank_overrides={"linear_kv_up_proj": 2})
    m, _ = _ours(tiny_share_dir, cfg, "sft")
    root = tmp_path_factory.mktemp("lora") / "run"
    save_checkpoint(root, 5, m, {"iteration": 5}, adapters={"sft": cfg})
    write_hf_meta(root / "hf", tiny_share_dir)
    ids = load_input_ids(None, 128, 2, 32, seed=4)
    with torch.no_grad():
        logits = forward_logits(m, ids)
    return root, ids, logits


def test_export_loads_in_peft_with_no_missing_keys_and_matches(lora_ckpt, tiny_share_dir, tmp_path):
    from glm5_mcore.convert.lora_export import export_checkpoint_adapter

    root, ids, ours = lora_ckpt
    out = export_checkpoint_adapter(root, tmp_path / "peft", "sft", progress=False)
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert {"mlp.gate_proj.weight", "shared_experts.up_proj.weight", "experts.gate_up_proj",
            "experts.down_proj"} <= set(cfg["target_parameters"])
    assert {"q_a_proj", "kv_b_proj", "wq_b"} <= set(cfg["target_modules"])
    pm, unexpected, missing = peft_model(tiny_share_dir, out)
    assert unexpected == [] and missing == []
    with torch.no_grad():
        theirs = pm(ids).logits
    assert (theirs - ours).abs().max() <= 1e-4


def test_merged_export_matches(lora_ckpt, tmp_path):
    from transformers import AutoModelForCausalLM

    from glm5_mcore.convert.lora_export import export_checkpoint_adapter

    root, ids, ours = lora_ckpt
    out = export_checkpoint_adapter(root, tmp_path / "merged", "sft", merged=True, progress=False)
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(ids).logits
    assert (theirs - ours).abs().max() <= 1e-4


def test_adapter_made_with_peft_imports_and_matches(tiny_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from glm5_mcore.parity import run_parity

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    cfg = LoraConfig(r=4, lora_alpha=16, init_lora_weights=False,
                     target_modules=["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "wq_b",
                                     "wk", "weights_proj"],
                     target_parameters=["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"])
    pm = get_peft_model(base, cfg)
    with torch.no_grad():  # peft's init_lora_weights=False leaves B small; make the adapter matter
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    pm.save_pretrained(tmp_path / "peft")
    ids = load_input_ids(None, 128, 2, 32, seed=6)
    rep = run_parity(tiny_dir, ids, ParallelConfig(), adapter=str(tmp_path / "peft"))
    assert rep["max_abs"] <= 1e-4 and rep["topk_agree"] == 1.0 and rep["router_agree"] == 1.0, rep
    plain = run_parity(tiny_dir, ids, ParallelConfig())
    assert plain["max_abs"] <= 1e-4
    with torch.no_grad():  # and the adapter does change the logits
        assert (pm(ids).logits - base.__class__.from_pretrained(tiny_dir, dtype=torch.float32)(ids).logits
                ).abs().max() > 1e-3


def test_per_expert_keys_and_split_gate_up_import(tmp_path):
    from glm5_mcore.lora.peft import import_peft

    g = torch.Generator().manual_seed(0)
    H, I, r = 64, 32, 3
    t = {}
    truth = {}
    for e in range(2):
        for kind, (o, i) in {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}.items():
            a, b = torch.randn(r, i, generator=g), torch.randn(o, r, generator=g)
            t[f"base_model.model.model.layers.1.mlp.experts.{e}.{kind}.lora_A.weight"] = a
            t[f"base_model.model.model.layers.1.mlp.experts.{e}.{kind}.lora_B.weight"] = b
            truth[(e, kind)] = b @ a * (6 / r)
    save_file(t, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 6}))
    st = import_peft(tmp_path, num_hidden_layers=4)
    for e in range(2):
        fc1 = st.delta(f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1")
        assert torch.allclose(fc1, torch.cat([truth[(e, "gate_proj")], truth[(e, "up_proj")]]), atol=1e-5)
        assert st.A[f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc1"].shape[0] == 2 * r
        fc2 = st.delta(f"decoder.layers.1.mlp.experts.local_experts.{e}.linear_fc2")
        assert torch.allclose(fc2, truth[(e, "down_proj")], atol=1e-5)


@pytest.mark.slow
def test_lora_cli_errors_name_the_path(tmp_path, lora_ckpt):
    root, _, _ = lora_ckpt
    r = glm5("lora", "export", "--ckpt", root, "--adapter", "nope", "--out", tmp_path / "x", ok=False)
    assert r.returncode == 2 and "adapters/nope" in r.stderr and "sft" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "x").exists()

"""What the vLLM engine's merged push sends (no vLLM needed): W + scale·B·A as transformers + peft merge
it, in the served folder's stored dtype, FP8 block-quantized where the folder stores FP8."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from glm5_mcore.checkpoint.hf_io import HFCheckpoint, dequantize_fp8_blocks


@pytest.fixture(scope="module")
def adapter(tiny_dir, tmp_path_factory):
    """A peft adapter on attention projections and (peft maps gate/up/down onto the fused expert
    parameters) the routed experts, random A and B (not a no-op); the reference is peft's own merge,
    saved by transformers in the on-disk per-expert layout."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    pm = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                         target_modules=["q_a_proj", "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    out = tmp_path_factory.mktemp("adapter") / "a"
    pm.save_pretrained(str(out))
    pm.merge_and_unload().save_pretrained(str(out.parent / "merged"))
    ref = HFCheckpoint(out.parent / "merged")
    return out, {k: ref.get(k) for k in ref.keys()}


def test_merged_push_equals_peft_merge(tiny_dir, adapter):
    from rl.rollout.vllm_weights import merged_weights

    path, ref = adapter
    got = merged_weights(tiny_dir, path)
    assert got and all(not k.startswith("model.layers.4.") for k in got)
    assert "model.layers.0.self_attn.q_a_proj.weight" in got and "model.layers.3.mlp.experts.7.up_proj.weight" in got
    # whole vLLM modules (its in-place reload rebuilds a module from one call): fused_qkv_a_proj's kv_a half
    # comes along at its base value though the adapter does not touch it
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa.weight" in got
    for k, v in got.items():
        assert v.dtype == torch.float32
        assert (v - ref[k]).abs().max() <= 1e-6, k
    from rl.rollout.vllm_weights import iter_merged_weights

    chunks = list(iter_merged_weights(tiny_dir, path, max_bytes=64 << 10))  # whole layers per chunk
    assert len(chunks) > 2 and sum(len(c) for c in chunks) == len(got)
    layers = [{k.split(".")[2] for k in c} for c in chunks]
    assert sum(len(x) for x in layers) == len(set().union(*layers))  # no layer split over two reloads
    assert all(torch.equal(c[k], got[k]) for c in chunks for k in c)
    untouched = "model.layers.0.self_attn.q_b_proj.weight"
    assert untouched not in got
    again = merged_weights(tiny_dir, path, also=(untouched,))
    assert torch.equal(again[untouched], HFCheckpoint(tiny_dir).get(untouched))


def test_merged_push_skips_no_op_adapters(tiny_dir, adapter, tmp_path):
    """An adapter whose B is zero (peft's init, or a family training left untouched) is not pushed: only the
    tensors a non-zero adapter changes (and the rest of their vLLM modules) go to the engine."""
    from safetensors.torch import load_file, save_file as save

    from rl.rollout.vllm_weights import merged_weights

    path, _ = adapter
    d = tmp_path / "noop"
    d.mkdir()
    (d / "adapter_config.json").write_bytes((path / "adapter_config.json").read_bytes())
    tensors = load_file(str(path / "adapter_model.safetensors"))
    save({k: torch.zeros_like(v) if ".experts." in k and "lora_B" in k else v for k, v in tensors.items()},
         str(d / "adapter_model.safetensors"))
    got = merged_weights(tiny_dir, d)
    assert "model.layers.0.self_attn.q_a_proj.weight" in got
    assert not [k for k in got if ".mlp.experts." in k]  # every routed expert's B is zero: none pushed


def test_merged_push_quantizes_where_the_folder_stores_fp8(tiny_dir, adapter, tmp_path):
    from glm5_mcore.checkpoint.fp8 import is_quantized, quantize_fp8_blocks
    from rl.rollout.vllm_weights import merged_weights

    path, ref = adapter
    src = HFCheckpoint(tiny_dir)
    tensors = {}
    for k in src.keys():
        v = src.get(k)
        if is_quantized(k):
            tensors[k], tensors[k + "_scale_inv"] = quantize_fp8_blocks(v)
        else:
            tensors[k] = v.bfloat16() if not k.endswith(("mlp.gate.weight", "e_score_correction_bias")) else v
    d = tmp_path / "fp8"
    d.mkdir()
    cfg = json.loads((Path(tiny_dir) / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(d / "model.safetensors"))
    got = merged_weights(d, path)
    fp8_base = HFCheckpoint(d)
    w = "model.layers.0.self_attn.q_a_proj.weight"
    assert got[w].dtype == torch.float8_e4m3fn and got[w + "_scale_inv"].dtype == torch.float32
    q, s = quantize_fp8_blocks(fp8_base.get(w) + (ref[w] - src.get(w)))
    assert torch.equal(got[w].view(torch.uint8), q.view(torch.uint8)) and torch.equal(got[w + "_scale_inv"], s)
    assert (dequantize_fp8_blocks(got[w], got[w + "_scale_inv"]) - ref[w]).abs().max() <= ref[w].abs().max() / 8


def test_engine_bad_settings_name_what_is_wrong(tiny_dir, tmp_path):
    from rl.rollout.vllm_engine import VLLMRolloutEngine

    with pytest.raises(FileNotFoundError, match="vllm_python=.*no-such-python"):
        VLLMRolloutEngine(tiny_dir, vllm_python=str(tmp_path / "no-such-python"), dense_mla=True, max_model_len=8)
    with pytest.raises(ValueError, match=r"index_topk \(8\) >= max_model_len \(256\)"):
        VLLMRolloutEngine(tiny_dir, vllm_python=str(tmp_path / "no-such-python"), dense_mla=True, max_model_len=256)

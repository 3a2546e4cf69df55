"""A frozen FP8 base (``model.base_dtype=fp8``, ``glm5_mcore.model.fp8_linear``) on the CPU: the model holds the
folder's e4m3 bytes and block scales as stored, and its logits and LoRA gradients equal those of the same
model with the base dequantized to fp32 on load (``HFCheckpoint.get``: ``dequantize_fp8_blocks``)."""

import pytest
import torch

from glm5_mcore.checkpoint.fp8 import is_quantized
from glm5_mcore.checkpoint.hf_io import HFCheckpoint
from glm5_mcore.lora.apply import apply_lora, merge
from glm5_mcore.lora.config import LoRAConfig
from glm5_mcore.model.build import forward_logits
from glm5_mcore.model.fp8_linear import BlockFP8Weight, check_base_dtype, stored_bytes
from glm5_mcore.parity import load_input_ids
from glm5_mcore.tiny import write_tiny

from tests.support.helpers import hf_model

BLOCK = 16  # the tiny model's widths are multiples of 16: several blocks per weight, fused gate/up on block edges
SEQ = 32    # > index_topk (8)
TARGETS = ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj",
           "linear_fc1", "linear_fc2", "experts.linear_fc1", "experts.linear_fc2")


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return write_tiny(tmp_path_factory.mktemp("fp8") / "tiny", mtp=True, fp8_block=BLOCK)


def _lora(m):
    apply_lora(m, LoRAConfig(rank=4, alpha=8, targets=TARGETS, init="random", seed=5))
    return m


def test_fp8_base_holds_the_stored_bytes(fp8_dir, single_rank):
    m, glm5 = hf_model(fp8_dir, base_fp8_block=BLOCK)
    fp8 = {n: p for n, p in m.named_parameters() if isinstance(p, BlockFP8Weight)}
    # every linear the folder stores in FP8 (MTP layer included), nothing else
    stored = [k for k in HFCheckpoint(fp8_dir).keys() if is_quantized(k)]
    assert len(stored) == 2 * len([n for n in fp8 if "linear_fc1" in n]) + len([n for n in fp8 if "linear_fc1" not in n])
    assert not any(isinstance(p, BlockFP8Weight) for n, p in m.named_parameters()
                   if "embedding" in n or "output_layer" in n or "router" in n or "weights_proj" in n or "eh_proj" in n)
    ckpt = HFCheckpoint(fp8_dir)
    w = fp8["decoder.layers.0.self_attention.linear_q_up_proj.weight"]
    q, s = ckpt.get_stored("model.layers.0.self_attn.q_b_proj.weight")
    assert torch.equal(w.data_fp8.view(torch.uint8), q.view(torch.uint8)) and torch.equal(w.scale_inv, s)
    fc1 = fp8["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]  # [gate; up], each 2 row-blocks
    qg, sg = ckpt.get_stored("model.layers.1.mlp.experts.3.gate_proj.weight")
    qu, su = ckpt.get_stored("model.layers.1.mlp.experts.3.up_proj.weight")
    assert torch.equal(fc1.data_fp8.view(torch.uint8), torch.cat([qg, qu]).view(torch.uint8))
    assert torch.equal(fc1.scale_inv, torch.cat([sg, su]))
    dense = sum(p.numel() for p in fp8.values())
    assert sum(stored_bytes(p) for p in fp8.values()) == dense + 4 * sum(p.scale_inv.numel() for p in fp8.values())
    assert all(not p.requires_grad and p.dtype == torch.float32 for p in fp8.values())


def test_fp8_base_logits_and_lora_grads_equal_the_dequantized_model(fp8_dir, single_rank):
    ids = load_input_ids(None, 128, 2, SEQ, seed=3)
    labels = torch.roll(ids, -1, 1)
    out = {}
    for kind, kw in (("fp8", {"base_fp8_block": BLOCK}), ("fp32", {})):
        m = _lora(hf_model(fp8_dir, **kw)[0]).train()
        assert any(isinstance(p, BlockFP8Weight) for p in m.parameters()) == (kind == "fp8")
        with torch.no_grad():
            logits = forward_logits(m.eval(), ids).clone()
        m.train()
        loss = m(ids, torch.arange(SEQ)[None].expand(2, -1), None, labels=labels).float().mean()
        loss.backward()
        out[kind] = logits, {n: p.grad.clone() for n, p in m.named_parameters() if p.requires_grad}
    (lf, gf), (ld, gd) = out["fp8"], out["fp32"]
    diff = (lf - ld).abs().max().item()
    assert diff <= 1e-6, f"logits max |diff| {diff:.3g}, mean {(lf - ld).abs().mean():.3g}"
    assert gf.keys() == gd.keys() and len(gf) > 40
    worst = max(((gf[k] - gd[k]).abs().max().item(), k) for k in gf)
    assert worst[0] <= 1e-6, f"LoRA grad max |diff| {worst[0]:.3g} at {worst[1]}"
    assert max(g.abs().max().item() for g in gd.values()) > 1e-3  # the gradients are not all ~0


def test_fp8_base_is_read_only_and_refused_for_full_fine_tuning(fp8_dir, single_rank):
    m = _lora(hf_model(fp8_dir, base_fp8_block=BLOCK)[0])
    with pytest.raises(RuntimeError, match="frozen FP8 base weight is read-only"):
        merge(m)
    with pytest.raises(ValueError, match="model.base_dtype=fp8 keeps the frozen base .* set lora.enabled=true"):
        check_base_dtype("fp8", trains_base=True)
    with pytest.raises(ValueError, match="model.base_dtype='bf8': expected null"):
        check_base_dtype("bf8", trains_base=False)

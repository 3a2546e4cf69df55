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


def _spec_leaves(spec, path):
    """(module path, what builds it) of every leaf slot of a Megatron-Core spec tree, named as the built model's
    modules are (a block's ``layer_specs[i]`` is its ``layers.{i}``)."""
    import dataclasses
    import functools

    from megatron.core.transformer.spec_utils import ModuleSpec

    if isinstance(spec, ModuleSpec):
        yield from _spec_leaves(spec.submodules, path) if spec.submodules is not None else [(path, spec.module)]
    elif isinstance(spec, functools.partial):
        subs = spec.keywords.get("submodules")
        yield from _spec_leaves(subs, path) if subs is not None else [(path, spec.func)]
    elif dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        for f in dataclasses.fields(spec):
            v = getattr(spec, f.name)
            if f.name == "layer_specs":
                for i, layer in enumerate(v):
                    yield from _spec_leaves(layer, f"{path}.layers.{i}")
            elif v is not None:
                yield from _spec_leaves(v, f"{path}.{f.name}")
    else:
        yield path, spec


def test_te_fp8_linears_are_exactly_the_release_fp8_weights(single_rank):
    """With the FP8 base on TE (``fp8_param``: every TE linear is built and computed in FP8), every slot of the
    decoder and MTP specs that a TE linear fills maps to a weight the release stores in FP8
    (``is_fp8_base_weight``); the indexer's ``linear_weights_proj`` and the MTP ``eh_proj``, bf16 in the release
    and in vLLM, are Megatron-Core's own linears there. (The layout is the 16 x H100 preset's.)"""
    from glm5_mcore.config import glm5_744b
    from glm5_mcore.mcore_settings import ParallelConfig
    from glm5_mcore.model.fp8_linear import is_fp8_base_weight
    from glm5_mcore.model.fp8_te import te_fp8_overrides
    from glm5_mcore.model.layer_spec import get_backend, get_glm5_decoder_block_spec, get_glm5_mtp_block_spec
    from tests.support.te_stand_in import te_version

    glm5 = glm5_744b()
    with te_version():
        cfg = glm5.to_mcore_config(ParallelConfig(tp=8, ep=16, cp=2), transformer_impl="transformer_engine",
                                   mtp_num_layers=1, bf16=True, params_dtype=torch.bfloat16, **te_fp8_overrides())
    te = get_backend("te")
    te_linears = [te.linear(), te.column_parallel_linear(), te.row_parallel_linear(),
                  te.column_parallel_layer_norm_linear()]
    leaves = [*_spec_leaves(get_glm5_decoder_block_spec(cfg, "te", pp_rank=0), "decoder"),
              *_spec_leaves(get_glm5_mtp_block_spec(cfg, "te", pp_rank=0), "mtp")]
    built = [(p, m) for p, m in leaves if not (p.endswith(".linear_q_proj") and cfg.q_lora_rank)]  # q_lora: unused
    te_sites = [p for p, m in built if any(m is c for c in te_linears)]
    bf16_in_fp8 = [p for p in te_sites if not is_fp8_base_weight(f"{p}.weight", glm5.num_hidden_layers)]
    assert not bf16_in_fp8, f"{len(bf16_in_fp8)} TE linears would hold and compute in FP8: {bf16_in_fp8[:3]} ..."
    names = {p.split(".", 3)[-1] for p in te_sites}
    assert {"self_attention.linear_kv_up_proj", "self_attention.core_attention.indexer.linear_wq_b",
            "mlp.shared_experts.linear_fc1", "mlp.linear_fc2"} <= names, sorted(names)
    kept = {p: m for p, m in built if p.endswith(("indexer.linear_weights_proj", ".eh_proj"))}
    assert len(kept) == glm5.num_hidden_layers + 2 and "mtp.layers.0.eh_proj" in kept  # MTP: its layer + eh_proj
    assert all(isinstance(m, type) and "transformer_engine" not in m.__module__ for m in kept.values())

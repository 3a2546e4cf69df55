"""Grouped expert GEMM (issue 28 D3): ``model.moe_grouped_gemm`` builds Megatron-Core's ``TEGroupedMLP`` (on the
CPU over ``cpu_compat.GroupedLinear``), whose per-expert ``weight{i}`` parameters every consumer of expert names
handles: the HF name table, the checkpoint bridge both ways, LoRA (per expert, as on ``SequentialMLP``), the planner's
fake ranks."""

import hashlib
from pathlib import Path

import pytest
import torch

from tests.support.helpers import hf_model

IDS = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))


def _experts(model, layer=1):
    return model.decoder.layers[layer].mlp.experts


def _sharded_layout(model) -> dict:
    """Sharded key -> (global shape, global offset, replica id) of every routed-expert entry of the
    checkpoint Megatron-Core would write (SwiGLU factories built into their two ShardedTensors)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory

    out = {}
    for v in model.sharded_state_dict().values():
        if ".mlp.experts." not in v.key:
            continue
        built = v.build() if isinstance(v, ShardedTensorFactory) else v
        for sh in (built.values() if isinstance(built, dict) else built if isinstance(built, list) else [built]):
            out.setdefault(sh.key, set()).add((tuple(sh.global_shape), tuple(sh.global_offset),
                                               tuple(sh.replica_id)))
    return out


def test_grouped_experts_are_te_grouped_mlp_and_compute_sequential_mlp(tiny_dir, single_rank):
    """``moe_grouped_gemm=True``: the routed experts are Megatron-Core's ``TEGroupedMLP`` with TE's parameter
    names (``linear_fc1.weight{i}`` [2I, H], ``linear_fc2.weight{i}`` [H, I]), loaded from HF through the name
    table; logits and every expert gradient equal ``SequentialMLP``'s bit for bit."""
    from megatron.core.transformer.moe.experts import SequentialMLP, TEGroupedMLP

    from glm5_mcore.model.build import forward_logits

    models, logits, grads = {}, {}, {}
    for grouped in (False, True):
        m, glm5 = hf_model(tiny_dir, moe_grouped_gemm=grouped)
        models[grouped] = m
        logits[grouped] = forward_logits(m, IDS)
        logits[grouped].float().pow(2).mean().backward()
        grads[grouped] = {n: p.grad for n, p in m.named_parameters() if ".mlp.experts." in n}
    g, s = _experts(models[True]), _experts(models[False])
    assert isinstance(g, TEGroupedMLP) and isinstance(s, SequentialMLP)
    E, H, I = glm5.n_routed_experts, glm5.hidden_size, glm5.moe_intermediate_size
    assert g.linear_fc1.weight0.shape == (2 * I, H) and getattr(g.linear_fc2, f"weight{E - 1}").shape == (H, I)
    for e in range(E):
        assert torch.equal(getattr(g.linear_fc1, f"weight{e}"), s.local_experts[e].linear_fc1.weight)
    assert torch.equal(logits[True], logits[False])
    seq = grads[False]
    for n, gr in grads[True].items():
        i, fc, e = n.split(".")[2], n.split(".")[-2], n.rsplit("weight", 1)[1]
        assert torch.equal(gr, seq[f"decoder.layers.{i}.mlp.experts.local_experts.{e}.{fc}.weight"]), n


def test_grouped_checkpoint_layout_is_sequential_mlps(tiny_dir, single_rank):
    """What Megatron-Core's save writes for the grouped experts (``TEGroupedMLP.sharded_state_dict`` over the
    grouped linear, moe/experts.py:912-954) is ``SequentialMLP``'s: the same keys on the global expert axis,
    shapes, offsets and replicas, so either layout resumes the other's checkpoint."""
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    model, _ = hf_model(tiny_dir, moe_grouped_gemm=True)
    assert isinstance(_experts(model), TEGroupedMLP)
    grouped, sequential = _sharded_layout(model), _sharded_layout(hf_model(tiny_dir)[0])
    assert "decoder.layers.1.mlp.experts.experts.linear_fc1.weight" in grouped
    assert grouped == sequential


def _tree_hash(d) -> dict:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(d).rglob("*")) if p.is_file()}


def test_grouped_round_trip_hf_megatron_hf_is_byte_identical(tiny_dir, tiny_converted, single_rank, tmp_path):
    """HF -> ``glm5 convert hf-to-mcore`` -> the grouped model (logits = the HF weights' ``SequentialMLP``), its
    own Megatron checkpoint -> ``mcore-to-hf``: every tensor equal to the source, and the exported folder
    byte-identical to the export of the ``SequentialMLP`` model's checkpoint."""
    from glm5_mcore.checkpoint.dist import load_model
    from glm5_mcore.checkpoint.hf_io import HFCheckpoint
    from glm5_mcore.checkpoint.layout import model_dir, write_hf_meta
    from glm5_mcore.convert.mcore_to_hf import mcore_to_hf
    from glm5_mcore.model.build import forward_logits
    from glm5_mcore.training.checkpointing import save_checkpoint

    from megatron.core.transformer.moe.experts import TEGroupedMLP

    ref, glm5 = hf_model(tiny_dir)
    grouped, _ = hf_model(tiny_dir, moe_grouped_gemm=True)
    assert isinstance(_experts(grouped), TEGroupedMLP)
    with torch.no_grad():
        for p in grouped.parameters():
            p.zero_()
        load_model(grouped, model_dir(tiny_converted))
        assert torch.equal(forward_logits(grouped, IDS), forward_logits(ref, IDS))
    exports = {}
    for name, m in (("grouped", grouped), ("sequential", ref)):
        save_checkpoint(tmp_path / name, 1, m)
        write_hf_meta(tmp_path / name / "hf", tiny_dir)
        exports[name] = mcore_to_hf(tmp_path / name, tmp_path / f"{name}_hf", max_shard_size="200KB", progress=False)
    src, back = HFCheckpoint(tiny_dir), HFCheckpoint(exports["grouped"])
    assert sorted(src.keys()) == sorted(back.keys())
    for k in src.keys():
        assert src.get(k).dtype == back.get(k).dtype and torch.equal(src.get(k), back.get(k)), k
    assert _tree_hash(exports["grouped"]) == _tree_hash(exports["sequential"])


def test_lora_on_grouped_experts_equals_sequential_mlp(tiny_dir, single_rank, tmp_path):
    """Issue 40: adapters on the grouped experts (``lora.grouped``: one ``LoRALayer`` per expert under
    ``SequentialMLP``'s names) give ``SequentialMLP``'s logits and adapter gradients, the same adapter state, and
    the same checkpoint layout, the adapter saved from either layout loads into the other; the SFT config check
    accepts them."""
    from glm5_mcore.lora.apply import adapter_parameters, apply_lora, lora_layers, merge
    from glm5_mcore.lora.config import EXPERTS, MLP, LoRAConfig, family_of
    from glm5_mcore.lora.state import gather_adapter, load_adapter_state, read_adapter_state, save_adapter
    from glm5_mcore.model.build import forward_logits
    from recipes.sft import validate
    from tests.support.sft_setup import sft_cfg

    assert family_of("decoder.layers.1.mlp.experts.linear_fc1") == "experts.linear_fc1"
    assert family_of("decoder.layers.1.mlp.shared_experts.linear_fc1") == "linear_fc1"
    cfg = LoRAConfig(rank=4, alpha=8.0, targets=MLP + EXPERTS, init="random")
    models, logits, grads, states, n = {}, {}, {}, {}, {}
    for grouped in (False, True):
        m, glm5 = hf_model(tiny_dir, moe_grouped_gemm=grouped)
        n[grouped] = apply_lora(m, cfg)
        logits[grouped] = forward_logits(m, IDS)
        logits[grouped].float().pow(2).mean().backward()
        grads[grouped] = {lora.module_name + k: p.grad for _, _, lora in lora_layers(m)
                          for k, p in (("A", lora.A["default"]), ("B", lora.B["default"]))}
        states[grouped] = gather_adapter(m, "default")
        save_adapter(m, "default", tmp_path / f"a{int(grouped)}")
        models[grouped] = m
    assert n[True] == n[False] and any(".local_experts." in k for k in states[True].A)
    assert (logits[True] - logits[False]).abs().max() <= 1e-6
    assert grads[True].keys() == grads[False].keys()
    assert all(torch.allclose(grads[True][k], grads[False][k], atol=1e-7) for k in grads[True])
    assert all(torch.equal(states[True].A[k], states[False].A[k]) for k in states[False].A)
    layout = _sharded_layout(models[True])  # the adapters (and their optimizer state) saved as SequentialMLP's
    assert "decoder.layers.1.mlp.experts.experts.linear_fc2.lora.B.default" in layout
    assert layout == _sharded_layout(models[False])
    for grouped in (False, True):  # resume across the layouts: the other layout's adapter, same logits
        m, _ = hf_model(tiny_dir, moe_grouped_gemm=grouped)
        load_adapter_state(m, read_adapter_state(tmp_path / f"a{int(not grouped)}"), "default")
        assert (forward_logits(m, IDS) - logits[False]).abs().max() <= 1e-6
    with torch.no_grad():  # merged into weight{i}: the same logits without the adapters' forward
        merge(models[True])
        assert (forward_logits(models[True], IDS) - logits[False]).abs().max() <= 1e-5
    assert len(adapter_parameters(models[True])) == 2 * n[True]
    validate(sft_cfg(tiny_dir, tmp_path, lora={"enabled": True, "targets": ["linear_proj", "experts.linear_fc1"]},
                     model={"hf_dir": tiny_dir, "moe_grouped_gemm": True}), glm5, 1)


def test_grouped_lora_delta_of_grouped_mm_is_the_per_expert_one():
    """The CUDA path of ``lora.grouped`` (two ``grouped_mm`` s over all experts, an empty expert included) computes
    the per-expert loop's delta; checked here with the CPU ``grouped_mm`` forward in bf16."""
    from glm5_mcore.lora.grouped import grouped_delta, grouped_fits

    g = torch.Generator().manual_seed(0)
    x, a, b = (torch.randn(*s, generator=g).to(torch.bfloat16) for s in ((10, 16), (3, 8, 16), (3, 24, 8)))
    splits = [3, 0, 7]
    ref = torch.cat([torch.nn.functional.linear(torch.nn.functional.linear(xi, a[e]), b[e]) * 0.5
                     for e, xi in enumerate(torch.split(x, splits))])
    assert grouped_fits(x, a, b) and not grouped_fits(x, a[:, :4], b[..., :4]) and not grouped_fits(x.float(), a, b)
    assert torch.equal(grouped_delta(x, splits, a, b, 0.5), ref)


def test_grouped_gemm_setting_defaults_on_for_te_only(tiny_dir, single_rank):
    """``model.moe_grouped_gemm``: null = on for the TE spec, off for the local spec; a bad value is named."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from glm5_mcore.mcore_settings import grouped_gemm
    from glm5_mcore.training.schema import ModelCfg

    assert ModelCfg().moe_grouped_gemm is None
    assert grouped_gemm(None, "te") and not grouped_gemm(None, "local")
    assert grouped_gemm(True, "local") and not grouped_gemm(False, "te")
    with pytest.raises(ValueError, match="model.moe_grouped_gemm='yes'"):
        grouped_gemm("yes", "te")
    m, _ = hf_model(tiny_dir)
    assert isinstance(_experts(m), SequentialMLP) and m.config.moe_grouped_gemm is False



def test_grouped_fits_checks_every_width_the_backward_strides():
    """``grouped_fits`` checks rank, in and out % 8 on one expert's factors (``a [r, in]``, ``b [out, r]``, what
    ``GroupedLoRA.delta`` passes) as on stacked ones: the backward's upstream gradient ``[T, out]`` is an operand of
    ``grouped_mm`` too, so out = 12 (a 24-byte bf16 row) does not fit."""
    from glm5_mcore.lora.grouped import grouped_fits

    x = torch.zeros(4, 16, dtype=torch.bfloat16)
    a, b = torch.zeros(8, 16, dtype=torch.bfloat16), torch.zeros(12, 8, dtype=torch.bfloat16)
    assert not grouped_fits(x, a, b) and not grouped_fits(x, a[None], b[None])
    assert grouped_fits(x, a, torch.zeros(16, 8, dtype=torch.bfloat16))


def test_grouped_lora_forward_uploads_its_offsets_without_a_host_sync(tiny_dir, single_rank, monkeypatch):
    """The stacked ``grouped_mm`` path of routed-expert LoRA (the stand-in device plays CUDA) copies each MoE layer's
    group offsets to the device once, shared by fc1 and fc2, and never with a blocking copy (on CUDA a
    ``torch.tensor(m_splits, device=cuda)`` waits for the stream in every fc1 and fc2)."""
    from glm5_mcore.config import GLM5Config
    from glm5_mcore.lora import grouped
    from glm5_mcore.lora.apply import apply_lora
    from glm5_mcore.lora.config import LoRAConfig
    from glm5_mcore.mcore_settings import ParallelConfig
    from glm5_mcore.model.build import build_model
    from glm5_mcore.probes.fake_device import fake_device
    from glm5_mcore.probes.host_writes import count_host_writes

    monkeypatch.setattr(grouped, "GROUPED_MM_DEVICES", {"cuda", "meta"})
    glm5 = GLM5Config.from_hf_dir(tiny_dir)
    stacked = []
    monkeypatch.setattr(grouped, "grouped_delta", lambda *a, f=grouped.grouped_delta: stacked.append(1) or f(*a))
    with fake_device() as dev:
        m = build_model(glm5, ParallelConfig(), moe_grouped_gemm=True, bf16=True, params_dtype=torch.bfloat16)
        apply_lora(m, LoRAConfig(rank=8, targets=("experts.linear_fc1", "experts.linear_fc2"), init="random",
                                 seed=1), "default")
        ids = torch.randint(3, 100, (1, 24), generator=torch.Generator().manual_seed(0)).to(dev)
        with torch.no_grad(), count_host_writes() as w:
            m(input_ids=ids, position_ids=torch.arange(24, device=dev)[None], attention_mask=None)
    moe_layers = sum(glm5.moe_layer_pattern)
    offsets = [u for u in w.uploads if "lora/grouped.py" in u[1] or "device.py" in u[1]]
    print("uploads:", w.uploads, "blocking:", w.blocking)
    assert len(stacked) == 2 * moe_layers  # fc1 and fc2 of every MoE layer took the grouped_mm path
    assert not w.blocking, w.blocking
    assert len(offsets) == moe_layers, offsets

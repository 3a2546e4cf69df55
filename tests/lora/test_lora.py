"""LoRA on every GLM-5 linear family: deltas are real, merge == adapter, disabled == base."""

import pytest
import torch

from glm5_mcore.lora.config import FAMILIES, INDEXER, LoRAConfig
from glm5_mcore.lora.apply import (adapter_parameters, apply_lora, disable_adapters, lora_layers, merge, set_adapter, unmerge)
from glm5_mcore.model.build import forward_logits
from glm5_mcore.parity import load_input_ids

from tests.support.helpers import hf_model

SEQ = 32  # > index_topk (8): the indexer's choice matters


def _model(hf_dir):
    return hf_model(hf_dir)[0].eval()


def _logits(m, ids):
    with torch.no_grad():
        return forward_logits(m, ids).clone()


@pytest.fixture()
def ids():
    return load_input_ids(None, 128, 2, SEQ, seed=3)


@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in INDEXER] + ["linear_wq_b"])
def test_family_delta_merge_and_disable(family, tiny_mtp_dir, ids, single_rank):
    m = _model(tiny_mtp_dir)
    base = _logits(m, ids)
    base_weights = {n: p.detach().clone() for n, p in m.named_parameters()}
    n = apply_lora(m, LoRAConfig(rank=4, alpha=8, targets=(family,), init="random"),
                   freeze_indexer=family not in INDEXER)
    assert n > 0
    with_adapter = _logits(m, ids)
    assert (with_adapter - base).abs().max() > 1e-3, family
    with disable_adapters(m):
        assert torch.equal(_logits(m, ids), base)
    assert merge(m) == n
    assert (_logits(m, ids) - with_adapter).abs().max() <= 1e-5, family
    assert unmerge(m) == n
    for name, p in m.named_parameters():
        if name in base_weights:
            assert (p - base_weights[name]).abs().max() <= 1e-6, name
    assert (_logits(m, ids) - with_adapter).abs().max() <= 1e-5


def test_base_frozen_grads_only_on_adapters_and_indexer_frozen(tiny_mtp_dir, ids, single_rank):
    m = _model(tiny_mtp_dir).train()
    apply_lora(m, LoRAConfig(rank=4, targets=("linear_q_up_proj", "linear_kv_up_proj", "linear_fc1",
                                               "experts.linear_fc2"), init="random"))
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert trainable and all(".lora." in n for n in trainable)
    labels = torch.roll(ids, -1, 1)
    loss = m(ids, torch.arange(SEQ)[None].expand(2, -1), None, labels=labels).float().mean()
    loss.backward()
    for n, p in m.named_parameters():
        if ".lora." in n:
            assert p.grad is not None and p.grad.abs().sum() > 0, n
        else:
            assert p.grad is None, n
    assert all(not p.requires_grad for n, p in m.named_parameters() if ".indexer." in n)
    assert len(adapter_parameters(m)) == len(trainable)


def test_indexer_targets_need_an_unfrozen_indexer(tiny_dir, single_rank):
    m = _model(tiny_dir)
    with pytest.raises(ValueError, match="indexer is frozen"):
        apply_lora(m, LoRAConfig(targets=("linear_wk",)))


def test_bad_target_and_rank_are_named(tiny_dir, single_rank):
    m = _model(tiny_dir)
    with pytest.raises(ValueError, match="unknown name"):
        apply_lora(m, LoRAConfig(targets=("q_proj",)))
    with pytest.raises(ValueError, match="linear_kv_down_proj: LoRA rank 64 does not fit"):
        apply_lora(m, LoRAConfig(rank=64, targets=("linear_kv_down_proj",)))
    with pytest.raises(ValueError, match="< 1"):
        apply_lora(m, LoRAConfig(rank=0))


def test_named_adapters_switch_and_default_init_is_a_no_op(tiny_dir, ids, single_rank):
    m = _model(tiny_dir)
    base = _logits(m, ids)
    apply_lora(m, LoRAConfig(rank=4), "zero")  # peft default: B = 0
    assert torch.equal(_logits(m, ids), base)
    apply_lora(m, LoRAConfig(rank=4, init="random", seed=1), "critic")
    assert torch.equal(_logits(m, ids), base)  # "zero" is still the active one
    set_adapter(m, "critic")
    critic = _logits(m, ids)
    assert (critic - base).abs().max() > 1e-3
    layers = list(lora_layers(m))
    assert layers and all(set(l.A) == {"zero", "critic"} for _, _, l in layers)
    with pytest.raises(ValueError, match="no LoRA adapter called 'nope'"):
        set_adapter(m, "nope")

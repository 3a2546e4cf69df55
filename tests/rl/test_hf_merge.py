"""The HF engine's adapter merged into its base weights (``rl.rollout.hf_merge``, ``merge_lora=True``): the
merged engine samples what PEFT's unmerged layers sample (tokens equal, log-probs to float rounding) for an
adapter on every family the trainer exports, routed experts included, over a sequence of pushes; every push
merges into the pristine base, so the base comes back bit for bit and a repeated adapter gives the same weights."""

import pytest
import torch
from transformers import AutoTokenizer

from rl.rollout.hf_merge import tuner_layers
from tests.support.rl_setup import perturb, rl_cfg, rollout

TARGETS = ["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj",
           "linear_fc1", "linear_fc2", "experts.linear_fc1", "experts.linear_fc2"]


@pytest.fixture(scope="module")
def adapters(tiny_dir):
    """Two adapter versions on every family (seeded B matrices)."""
    from rl.train.trainer import PolicyTrainer

    cfg = rl_cfg(tiny_dir, lora={"rank": 8, "alpha": 16, "targets": TARGETS},
                 rollout={"temperature": 0.9, "max_new_tokens": 12})
    trainer = PolicyTrainer(cfg)
    out = []
    for v in (1, 2):
        perturb(trainer, seed=v)
        out.append(trainer.export_adapter(v))
    return cfg, out


def test_merged_engine_samples_the_unmerged_policy_and_restores_the_base(tiny_dir, adapters):
    from rl.rollout.hf_engine import HFRolloutEngine

    cfg, (v1, v2) = adapters
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    merged, plain = HFRolloutEngine(tiny_dir), HFRolloutEngine(tiny_dir, merge_lora=False)
    def weights():  # the base tensors by their transformers names (PEFT inserts ``base_layer``)
        return {n.replace(".base_layer", ""): p.detach().clone() for n, p in merged.model.named_parameters()
                if "lora_" not in n}

    base = weights()
    after_v1 = None
    for step, payload in enumerate([v1, v2, None, v2, v1]):
        merged.load_adapter(payload)
        plain.load_adapter(payload)
        _, a = rollout(cfg, merged, tok, step=step, count=4)
        _, b = rollout(cfg, plain, tok, step=step, count=4)
        for x, y in zip(a, b):
            assert x.response_ids == y.response_ids
            assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
        layers = tuner_layers(merged.peft)
        assert all(m.merged for m in layers) == (payload is not None)
        assert not any(m.merged for m in tuner_layers(plain.peft))
        now = weights()
        assert set(now) == set(base)
        if payload is None:  # the pristine base, bit for bit
            assert all(torch.equal(now[n], base[n]) for n in now)
        elif payload is v1:
            if after_v1 is None:
                after_v1 = now
                moved = [n for n in now if not torch.equal(now[n], base[n])]
                assert any(".experts." in n for n in moved) and any("kv_b_proj" in n for n in moved), moved
            else:  # merged into the pristine base again: no drift from the pushes in between
                assert all(torch.equal(now[n], after_v1[n]) for n in now)


def test_merge_lora_must_be_a_bool(tiny_dir):
    from rl.rollout.hf_engine import HFRolloutEngine

    with pytest.raises(ValueError, match=r"^rollout.engine_kwargs.merge_lora='yes' must be true or false$"):
        HFRolloutEngine.check_kwargs({"merge_lora": "yes"})

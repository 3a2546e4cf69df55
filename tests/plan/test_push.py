"""The planner's push bytes (``glm5_mcore.plan.push``) equal what the vLLM engine sends for the same targets — a
merged push (``rl.rollout.vllm_weights.merged_weights``) and a LoRA-mode push (``rl.rollout.vllm_lora``: the
adapter's tensors, the rest merged) — and the 744B figures the RL presets cite."""

import torch

from glm5_mcore.config import GLM5Config, glm5_744b
from glm5_mcore.lora.config import DEFAULT_TARGETS, EXPERTS
from glm5_mcore.plan.push import lora_push_bytes, merged_push_bytes


def test_push_bytes_equal_the_engines_merged_push(tiny_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rl.rollout.vllm_weights import merged_weights

    base = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    for hf, ours in ((["q_a_proj", "o_proj"], ("linear_q_down_proj", "linear_proj")),
                     (["gate_proj", "up_proj", "down_proj"], EXPERTS),  # transformers 5: the routed experts only
                     (["kv_b_proj"], ("linear_kv_up_proj",))):
        pm = get_peft_model(base, LoraConfig(r=2, lora_alpha=4, init_lora_weights=False, target_modules=hf))
        out = tmp_path / hf[0]
        pm.save_pretrained(str(out))
        base = pm.unload()
        got = merged_weights(tiny_dir, out)
        sent = sum(v.numel() for v in got.values()) * 2  # the tiny folder stores fp32; the planner counts bf16
        assert sent == sum(merged_push_bytes(GLM5Config.from_hf_dir(tiny_dir), ours, fp8=False).values()), hf


def test_744b_push_bytes_routed_experts_dominate():
    m = glm5_744b()
    default = merged_push_bytes(m, DEFAULT_TARGETS, fp8=True)
    full = merged_push_bytes(m, DEFAULT_TARGETS + EXPERTS, fp8=True)
    assert not any(k.startswith("experts.") for k in default)
    assert round(sum(default.values()) / 1e9, 1) == 16.4
    assert round((full["experts.linear_fc1"] + full["experts.linear_fc2"]) / 1e9, 1) == 725.0
    one = merged_push_bytes(m, ("experts.linear_fc2",), fp8=True)  # one expert linear: the whole FusedMoE
    assert one == {k: full[k] for k in ("experts.linear_fc1", "experts.linear_fc2")}


def test_lora_mode_push_bytes_equal_the_engines_adapter(tiny_dir):
    """LoRA mode sends the served families' A and B (the routed experts in PEFT's 3D form) in the payload's dtype
    and merges kv_b_proj: the planner's count of both, for the tiny model's full stack (fp32 payload here)."""
    from safetensors.torch import load

    from glm5_mcore.lora.config import MLA, MLP
    from rl.config import RLConfig
    from rl.rollout.vllm_lora import served_adapter
    from rl.train.trainer import PolicyTrainer
    from tests.support.certificate import randomize_adapters

    targets = MLA + MLP + EXPERTS
    trainer = PolicyTrainer(RLConfig.from_dict({"model": {"hf_dir": tiny_dir}, "wandb": {"mode": "disabled"},
                                                "lora": {"targets": list(targets), "rank": 4}}))
    randomize_adapters(trainer.model, seed=1)
    served = served_adapter(trainer.export_adapter(1).files, trainer.glm5.num_hidden_layers)
    sent = sum(t.numel() * t.element_size() for t in load(served.data).values())
    want = lora_push_bytes(GLM5Config.from_hf_dir(tiny_dir), targets, 4, fp8=False, dtype_bytes=4)
    assert sent == sum(v for k, v in want.items() if not k.startswith("merged:"))
    assert set(k for k in want if k.startswith("merged:")) == {"merged:linear_kv_up_proj"}


def test_744b_lora_mode_push_is_the_adapter():
    """Full-stack LoRA at rank 16 in bf16: 11.53 GB a push (98 % routed experts) against a 742 GB merged push."""
    m = glm5_744b()
    served = [t for t in DEFAULT_TARGETS + EXPERTS if t != "linear_kv_up_proj"]
    lora = lora_push_bytes(m, served, 16, fp8=True)
    routed = lora["experts.linear_fc1"] + lora["experts.linear_fc2"]
    assert round(sum(lora.values()) / 1e9, 2) == 11.53 and routed / sum(lora.values()) > 0.98
    assert sum(merged_push_bytes(m, served, fp8=True).values()) / sum(lora.values()) > 60

"""The planner's merged push bytes (``glm5_mcore.plan.push``) equal what the vLLM engine's merged push sends
(``rl.rollout.vllm_weights.merged_weights``) for the same targets, and the 744B figures the RL presets cite."""

import torch

from glm5_mcore.config import GLM5Config, glm5_744b
from glm5_mcore.lora.config import DEFAULT_TARGETS, EXPERTS
from glm5_mcore.plan.push import merged_push_bytes


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

"""Megatron-Bridge 0.6.2's own code on our checkpoints, on CPU (manual check; run by run.sh in the side env).

    bridge_side.py export HF_DIR MEGATRON_DIR OUT_HF      AutoBridge.export_ckpt: Bridge reads a Megatron folder
    bridge_side.py import HF_DIR OUT_MEGATRON             AutoBridge.import_ckpt: Bridge writes one
    bridge_side.py peft   HF_DIR BASE_MEGATRON OUT        Bridge's LoRA on the model, random adapters, saved as its
                                                          PEFT training saves them (+ OUT_hfpeft: its HF export)

Bridge builds GLM-5 with Transformer Engine layers and CUDA-only settings; here its provider is given
Megatron-Core's local-backend GLM-5 spec (``glm5_mcore.model.layer_spec``, the same sharded keys) and CPU
settings (no fusions, allgather dispatcher, no grouped GEMM), and ``glm5_mcore.cpu_compat``. Everything
that reads or writes a checkpoint, maps names or converts to HF is Bridge's own code.
"""
import os
import sys
import time

import bridge_env  # noqa: F401
import torch


def _patch(glm5) -> None:
    import megatron.bridge.models.gpt_provider as gp
    import megatron.core.transformer.transformer_config as tcm
    from megatron.bridge.models.conversion.param_mapping import AutoMapping

    from glm5_mcore import cpu_compat
    from glm5_mcore.model.layer_spec import get_glm5_decoder_block_spec, get_glm5_mtp_block_spec

    cpu_compat.apply()
    cpu = dict(use_cpu_initialization=True, moe_token_dispatcher_type="allgather", moe_shared_expert_overlap=False,
               moe_flex_dispatcher_backend=None, moe_permute_fusion=False, gradient_accumulation_fusion=False,
               bias_activation_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
               persist_layer_norm=False, moe_grouped_gemm=False)
    provide, post_init = gp.GPTModelProvider.provide, tcm.TransformerConfig.__post_init__

    def provide_cpu(self, *a, **k):
        for f, v in cpu.items():
            setattr(self, f, v)
        self.glm5 = glm5
        self.transformer_layer_spec = lambda config, vp_stage=None: get_glm5_decoder_block_spec(config, "local",
                                                                                                vp_stage)
        return provide(self, *a, **k)

    def post_init_cpu(self):
        self.moe_permute_fusion = self.moe_grouped_gemm = self.gradient_accumulation_fusion = False
        return post_init(self)

    gp.GPTModelProvider.provide = provide_cpu
    tcm.TransformerConfig.__post_init__ = post_init_cpu
    gp.mtp_block_spec = lambda config, vp_stage=None: get_glm5_mtp_block_spec(config, "local", vp_stage)
    AutoMapping.register_module_type("DuplicatedLinear", "replicated")  # our indexer weights_proj
    torch.cuda.set_device = lambda *a, **k: None
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()


def main() -> None:
    from megatron.bridge import AutoBridge

    from glm5_mcore.config import GLM5Config

    from glm5_mcore.mcore_settings import ParallelConfig
    cmd, hf = sys.argv[1], sys.argv[2]
    _patch(GLM5Config.from_hf_dir(hf))
    t = time.time()
    if cmd == "export":
        from megatron.bridge.training.model_load_save import temporary_distributed_context  # noqa: F401

        AutoBridge.from_hf_pretrained(hf).export_ckpt(sys.argv[3], sys.argv[4], show_progress=False)
    else:
        from glm5_mcore.model.parallel import init_parallel

        init_parallel(ParallelConfig())
        if cmd == "import":
            AutoBridge.import_ckpt(hf, sys.argv[3])
        else:
            _peft(AutoBridge.from_hf_pretrained(hf), hf, sys.argv[3], sys.argv[4])
    print(f"bridge {cmd}: {time.time() - t:.1f}s", flush=True)


def _peft(bridge, hf: str, base: str, out: str) -> None:
    """Bridge's LoRA (dim 4, alpha 8) on every MLA / MLP / expert linear, random adapter weights, saved
    through its own ``apply_peft_adapter_filter_to_state_dict`` + ``dist_checkpointing.save`` and its HF
    PEFT export (``save_hf_adapter``); the adapter parameters as the model holds them in OUT/adapters.pt."""
    import yaml
    from megatron.core import dist_checkpointing

    import megatron.bridge.peft.utils as peft_utils
    from megatron.bridge.peft.lora import LoRA
    from megatron.bridge.training.checkpointing import (_generate_model_state_dict,
                                                        apply_peft_adapter_filter_to_state_dict)

    peft_utils.HAVE_TE = False  # its TE class checks see the stubs otherwise
    canonical = os.environ.get("BRIDGE_PEFT") == "canonical"
    model = bridge.to_megatron_model(wrap_with_ddp=False, use_cpu_initialization=True)
    if canonical:  # CanonicalLoRA: gate and up of fc1 with their own adapters
        from megatron.bridge.peft.canonical_lora import CanonicalLoRA

        targets = ["linear_proj", "linear_fc1_gate", "linear_fc1_up", "linear_fc2"]
        lora = CanonicalLoRA(target_modules=targets, dim=4, alpha=8)
        target = "megatron.bridge.peft.canonical_lora.CanonicalLoRA"
    else:
        targets = ["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj",
                   "linear_proj", "linear_fc1", "linear_fc2"]
        lora = LoRA(target_modules=targets, dim=4, alpha=8, share_expert_adapters=False)
        target = "megatron.bridge.peft.lora.LoRA"
    model = lora(model, training=False)
    g, adapters = torch.Generator().manual_seed(0), {}
    with torch.no_grad():
        for n, p in model[0].named_parameters():
            if ".adapter." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
                adapters[n] = p.detach().clone()
    sd = apply_peft_adapter_filter_to_state_dict(_generate_model_state_dict(model, {}), lora)
    sd.update(checkpoint_version=3.0, iteration=10)
    it = os.path.join(out, "iter_0000010")
    os.makedirs(it)
    dist_checkpointing.save(sd, it)
    with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write("10")
    with open(os.path.join(base, "iter_0000000", "run_config.yaml")) as f:
        rc = yaml.safe_load(f)
    rc["peft"] = {"_target_": target, "dim": 4, "alpha": 8, "target_modules": targets}
    rc.setdefault("checkpoint", {})["pretrained_checkpoint"] = os.path.abspath(base)
    with open(os.path.join(it, "run_config.yaml"), "w") as f:
        yaml.safe_dump(rc, f)
    torch.save(adapters, os.path.join(out, "adapters.pt"))
    if not canonical:
        bridge.save_hf_adapter(model, out + "_hfpeft", peft_config=lora, base_model_name_or_path=hf,
                               show_progress=False)


if __name__ == "__main__":  # dist_checkpointing's async writer spawns processes that re-import this file
    main()

"""bf16 correctness: log-prob passes take log-softmax of fp32 logits (``fp32_output_layer``), and
gradients are reduced in fp32 (``grad_reduce_in_fp32``)."""

import torch

from glm5_mcore.config import GLM5Config


from glm5_mcore.mcore_settings import ParallelConfig
def test_bf16_log_probs_are_within_fp32_rounding_of_an_fp32_projection(tiny_dir, single_rank):
    """A bf16 model's log-probs against float64 log_softmax of the same final hidden state through the
    same output weight: within fp32 rounding with the fp32 output layer; off by the bf16 rounding of
    the logits without it (today's path)."""
    from glm5_mcore.lora.config import LoRAConfig
    from glm5_mcore.lora.apply import apply_lora
    from glm5_mcore.model.build import build_model, packed_seq_params_from_lengths
    from glm5_mcore.checkpoint.hf_load import load_hf_weights
    from glm5_mcore.model.mtp_loss import fp32_output_layer, token_logprobs

    glm5 = GLM5Config.from_hf_dir(tiny_dir)
    m = build_model(glm5, ParallelConfig(), bf16=True, params_dtype=torch.bfloat16, mtp_num_layers=None)
    load_hf_weights(m, tiny_dir, glm5)
    apply_lora(m, LoRAConfig(rank=4, init="random", seed=1), "default")
    m.eval()
    g = torch.Generator().manual_seed(0)
    lengths = [13, 19]
    ids = torch.randint(3, glm5.vocab_size, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    targets = torch.randint(3, glm5.vocab_size, (sum(lengths),), generator=g)
    psp = packed_seq_params_from_lengths(lengths)
    temperature = 0.8
    hidden = []
    m.output_layer.register_forward_pre_hook(lambda mod, args: hidden.append(args[0].detach()))

    @torch.no_grad()
    def logp():
        logits = m(input_ids=ids, position_ids=pos, attention_mask=None, packed_seq_params=psp)[0]  # [T, V]
        return token_logprobs(logits, targets, None, temperature)[0].double()

    bf16_logits = logp()
    h = hidden[-1][:, 0].double()  # [T, H] bf16 values
    assert hidden[-1].dtype == torch.bfloat16
    ref = torch.log_softmax(h @ m.output_layer.weight.double().T / temperature, -1)
    ref = ref.gather(-1, targets[:, None])[:, 0]
    handle = fp32_output_layer(m)
    fp32_logits = logp()
    handle.remove()
    assert torch.equal(hidden[-1], hidden[0])  # the same hidden states on both paths
    err_fp32 = float((fp32_logits - ref).abs().max())
    err_bf16 = float((bf16_logits - ref).abs().max())
    print(f"bf16 log-probs vs float64 reference: max |diff| fp32 output layer {err_fp32:.3g}, "
          f"bf16 logits {err_bf16:.3g} (mean |log p| {float(ref.abs().mean()):.3g})")
    assert err_fp32 <= 2e-6 * max(1.0, float(ref.abs().max())), err_fp32
    assert err_bf16 >= 20 * err_fp32, (err_bf16, err_fp32)


def test_grad_reduce_in_fp32_under_bf16(tiny_dir, single_rank, monkeypatch):
    """The bf16 trainer's DDP accumulates and reduces gradients in fp32 (Megatron-LM's default for
    bf16). Megatron's Float16Optimizer takes CUDA tensors only, so the DDP it is handed is inspected."""
    import megatron.core.optimizer as mopt
    import pytest

    from glm5_mcore.model.build import build_model
    from glm5_mcore.training.loop import OptimCfg, build_trainer

    class Handed(Exception):
        pass

    def capture(config, model_chunks, *args, **kwargs):
        raise Handed(config, model_chunks[0])

    monkeypatch.setattr(mopt, "get_megatron_optimizer", capture)
    glm5 = GLM5Config.from_hf_dir(tiny_dir)
    m = build_model(glm5, ParallelConfig(), bf16=True, params_dtype=torch.bfloat16, mtp_num_layers=None)
    with pytest.raises(Handed) as e:
        build_trainer(m, OptimCfg(), 1, bf16=True)
    config, ddp = e.value.args
    assert config.bf16 and ddp.ddp_config.grad_reduce_in_fp32
    assert ddp.buffers and all(buf.grad_dtype == torch.float32 for buf in ddp.buffers)
    assert all(p.main_grad.dtype == torch.float32 for p in m.parameters() if p.requires_grad)

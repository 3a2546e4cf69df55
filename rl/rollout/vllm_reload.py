"""What runs on each vLLM worker for a weight push (``rl.rollout.vllm_server`` sends these functions through
``LLM.collective_rpc``, pickled by module name): checkpoint-format tensors reloaded in place into the served model
(``reload_from_file``: a safetensors file; ``reload_from_handle``: a ``rl.rollout.weight_sync`` bucket) or into
the speculative draft model (the MTP layer), the draft's parameters read back, and the vLLM-CPU routed-expert
prepack an in-place reload skips (``reprepack_cpu_experts_on_reload``). It runs in the vLLM process and imports
vLLM, torch and ``rl.rollout.weight_sync`` only."""

from __future__ import annotations


def reprepack_cpu_experts_on_reload(model) -> int:
    """vLLM-CPU workaround, installed on ``model`` before each in-place reload; returns the MoE layers patched.

    Wall: ``UnquantizedFusedMoEMethod._setup_kernel`` (vllm/model_executor/layers/fused_moe/
    unquantized_fused_moe_method.py:188-205) runs the experts' own ``process_weights_after_loading`` only
    while ``moe_kernel is None`` (the first load); on vLLM-CPU that is the prepack of ``w13_weight`` /
    ``w2_weight`` [E, 2I, H] / [E, H, I] into the grouped-GEMM layout (experts/cpu_moe.py:208-218,
    ``cpu_prepack_moe_weight``: same shape, other order). An in-place reload
    (``model_loader/reload/layerwise.py:_layerwise_process``) re-runs the method, which copies the reloaded
    checkpoint-layout experts into the prepacked storage and skips the prepack: the CPU kernel then reads
    them as packed, and every routed expert of a reloaded layer is wrong (a full push after a level-2
    sleep, or any adapter on experts: log-probs ~3 off). The patch makes the method, per layer instance,
    prepack again after it ran on a weight update; it runs exactly for the layers a reload brought.
    Other platforms: nothing (0)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return 0
    from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

    n = 0
    for layer in model.modules():
        method = getattr(layer, "quant_method", None)
        experts = getattr(getattr(method, "moe_kernel", None), "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(method, "_glm5_reprepack", False):
            continue

        def after_loading(layer_, _run=method.process_weights_after_loading, _experts=experts):
            size = _experts.moe_config.intermediate_size_per_partition
            if _experts._padded_intermediate_size(_experts.moe_config) != size:
                raise NotImplementedError(f"vLLM-CPU: in-place reload of MoE experts with a padded intermediate "
                                          f"size ({size}) is not supported (experts/cpu_moe.py:220)")
            _run(layer_)
            _experts.process_weights_after_loading(layer_)

        method.process_weights_after_loading = after_loading
        method._glm5_reprepack = True
        n += 1
    return n


def reload(worker, tensors) -> None:
    """``worker.reload_weights`` of checkpoint-format (HF name, tensor) pairs, the CPU MoE prepack restored."""
    reprepack_cpu_experts_on_reload(worker.model_runner.get_model())
    worker.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)


def reload_from_file(worker, path: str) -> int:
    """Run on every vLLM worker: reload the checkpoint-format tensors of one safetensors file."""
    from safetensors.torch import load_file

    tensors = load_file(path)
    reload(worker, tensors.items())
    return len(tensors)


def reload_from_handle(worker, handle, metas, codec: str, draft: bool = False) -> int:
    """Run on every vLLM worker: reload the tensors of one weight-sync bucket (``rl.rollout.weight_sync``: CUDA IPC
    on GPUs, the shared-file stand-in on CPU) as views of the sender's memory, no file in between."""
    from rl.rollout.weight_sync import receive

    tensors = receive(handle, metas, codec)
    if draft:
        return reload_draft(worker, tensors)
    reload(worker, tensors)
    return len(tensors)


def draft_model(worker):
    """The speculative-decoding draft model of a vLLM worker: ``model_runner.get_draft_model()``, which
    both of vLLM 0.32's runners have — V1 (``gpu_model_runner.py:3122``, ``self.drafter``; the CPU build's)
    and Model Runner V2 (``gpu/model_runner.py:562``, ``self.speculator``; CUDA's default, and what
    ``enable_return_routed_experts`` requires). A runner without it: V1's ``drafter.model``."""
    runner = worker.model_runner
    get = getattr(runner, "get_draft_model", None)
    model = get() if get is not None else getattr(getattr(runner, "drafter", None), "model", None)
    if model is None:
        raise RuntimeError("this vLLM engine has no draft model (speculative_config method 'mtp' not set)")
    return model


def reload_draft_from_file(worker, path: str) -> int:
    """Run on every vLLM worker: reload the MTP layer's checkpoint-format tensors (HF names
    ``model.layers.{num_hidden_layers}.*``) of one safetensors file into the draft model, with vLLM's
    in-place reload (``model_loader/reload/inplace.py``: the draft's own ``load_weights`` name mapping —
    ``mtp_block.``, fused q_a/kv_a, gate/up, FusedMoE experts — then ``process_weights_after_loading``
    for the modules it touched, e.g. MLA's ``W_UK_T`` / ``W_UV`` from ``kv_b_proj``), under the draft's
    model config."""
    from safetensors.torch import load_file

    return reload_draft(worker, list(load_file(path).items()))


def reload_draft(worker, tensors: list) -> int:
    """(HF name, tensor) pairs of the MTP layer into the draft model (see ``reload_draft_from_file``)."""
    from types import SimpleNamespace

    from vllm.model_executor.model_loader.reload.inplace import reload_weights

    runner = worker.model_runner
    cfg = SimpleNamespace(model_config=runner.vllm_config.speculative_config.draft_model_config,
                          load_config=runner.vllm_config.load_config, lora_config=None)
    reprepack_cpu_experts_on_reload(draft_model(worker))
    reload_weights(cfg, draft_model(worker), weights_iterator=iter(tensors), weights_path=None,
                   is_checkpoint_format=True)
    return len(tensors)


def draft_weights(worker, names=None) -> dict:
    """Run on a vLLM worker: the draft model's parameters (vLLM names → numpy float32 arrays). vLLM's CPU
    build prepacks linear weights for its GEMM kernels and leaves ``weight`` empty
    (model_executor/layers/utils.py:470 ``dispatch_cpu_unquantized_gemm``); such a weight is read back
    as the layer computes it: its ``cpu_linear`` applied to the identity, transposed."""
    import torch

    out = {}
    with torch.no_grad():
        for mod_name, mod in draft_model(worker).named_modules():
            for n, p in mod.named_parameters(recurse=False):
                name = f"{mod_name}.{n}" if mod_name else n
                if names is not None and name not in names:
                    continue
                k = next((getattr(mod, a) for a in ("input_size_per_partition", "input_size", "in_features")
                          if hasattr(mod, a)), None)
                if n == "weight" and p.numel() == 0 and hasattr(mod, "cpu_linear") and k:
                    p = mod.cpu_linear(torch.eye(k, dtype=p.dtype), p, None).t()
                out[name] = p.detach().float().cpu().numpy()
    return out

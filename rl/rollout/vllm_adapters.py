"""LoRA adapters handed to vLLM 0.32 from memory (the vLLM side of ``VLLMRolloutEngine``'s LoRA mode): no adapter
file is written or read. It runs in the vLLM process (``rl.rollout.vllm_server``) and imports vLLM and torch only.

vLLM loads an adapter from a folder (``LoRARequest.lora_path``, ``WorkerLoRAManager._load_adapter``,
``lora/worker_manager.py:106-174``). As verl and SkyRL do for in-memory adapters, each worker keeps the pushed
tensors under the adapter's id and its manager's ``_load_adapter`` builds the ``LoRAModel`` from them with vLLM's
own ``LoRAModel.from_lora_tensors`` (``lora_model.py:120``) whenever the path is ``MEMORY`` + name, with the same
steps as the folder path: ``PEFTHelper`` validation against the engine's ``LoRAConfig`` (``max_lora_rank``), the
model's weights mapper and skip prefixes, the MoE layout check (``_validate_moe_lora_format``). Once loaded, the
pushed tensors are let go: vLLM's ``LoRAModel`` keeps what this worker serves (its own experts under expert
parallelism, ``model_manager.py:838-944``), and the engine keeps ``max_cpu_loras`` above the versions in flight,
so vLLM's CPU cache never evicts one a request still needs.

``add`` loads the adapter at once (errors surface at the push, not at the first request) and checks that every
module it carries reached a LoRA layer of the model (vLLM's folder path refuses unexpected modules before
loading, ``lora_model.py:268-279``; a module that matches none would otherwise be silently ignored).

Routed experts come in PEFT's fused 3D form (``glm5_mcore.lora.peft``): the engine starts with
``enable_mixed_moe_lora_format=True`` and each request says ``is_3d_lora_weight=True``; vLLM converts them to its
per-expert buffers (``model_manager.py:1040``)."""

from __future__ import annotations

MEMORY = "glm5-memory://"
"""``LoRARequest.lora_path`` of an adapter whose tensors the workers hold (never a folder)."""

_HELD: dict[int, tuple[dict, dict]] = {}  # in each worker process, while one loads: lora_int_id -> (config, tensors)


def lora_request(name: str, lora_id: int, is_3d: bool):
    """The ``vllm.lora.request.LoRARequest`` of an in-memory adapter."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=MEMORY + name, is_3d_lora_weight=is_3d)


def _load_from_memory(manager, request):
    """``WorkerLoRAManager._load_adapter`` for ``MEMORY`` paths: ``from_lora_tensors`` on the held tensors."""
    from vllm.lora.peft_helper import PEFTHelper

    if request.lora_int_id not in _HELD:
        raise ValueError(f"vLLM LoRA {request.lora_name} (id {request.lora_int_id}) left vLLM's CPU cache while a "
                         "request needed it: max_cpu_loras must exceed the adapter versions in flight (max_loras)")
    config, tensors = _HELD[request.lora_int_id]
    peft = PEFTHelper.from_dict({**config, "vllm_max_position_embeddings": manager.max_position_embeddings})
    peft.validate_legal(manager.lora_config)
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=request.lora_int_id, tensors=tensors, peft_helper=peft, device="cpu",
        dtype=manager.lora_config.lora_dtype, model_vocab_size=manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    lora.is_3d_lora_weight = request.is_3d_lora_weight
    manager._adapter_manager._validate_moe_lora_format(lora)
    return lora


def _install(manager) -> None:
    """Route this worker manager's ``MEMORY`` loads to ``_load_from_memory`` (once per manager instance)."""
    if getattr(manager, "_glm5_memory", False):
        return
    by_path = manager._load_adapter

    def load(request):
        if request.lora_path.startswith(MEMORY):
            return _load_from_memory(manager, request)
        return by_path(request)

    manager._load_adapter = load
    manager._glm5_memory = True


def add(worker, name: str, lora_id: int, config: dict, tensors: dict, is_3d: bool) -> list[str]:
    """Run on every vLLM worker: load ``tensors`` (PEFT names → tensors) as the adapter ``name``, LoRA ``lora_id``;
    returns the vLLM modules it adapts. A module of the adapter that reaches no LoRA layer of the model is an error
    naming it."""
    manager = worker.model_runner.lora_manager
    _install(manager)
    _HELD[lora_id] = (dict(config), {k: v.clone() if v.is_shared() else v for k, v in tensors.items()})
    try:
        manager.add_adapter(lora_request(name, lora_id, is_3d))
        loaded = manager._adapter_manager.get_adapter(lora_id)
        stray = sorted(set(loaded.loras) - set(manager._adapter_manager.modules))
        if stray:
            raise ValueError(f"vLLM LoRA {name}: {len(stray)} adapted modules are no LoRA layer of the served model "
                             f"(e.g. {stray[:3]}); vLLM would serve them as base")
    except BaseException:
        remove(worker, lora_id)
        raise
    finally:
        _HELD.pop(lora_id, None)  # vLLM's LoRAModel holds what it serves (this rank's experts); not twice
    return sorted(loaded.loras)


def remove(worker, lora_id: int) -> bool:
    """Run on every vLLM worker: the adapter out of vLLM's caches and its tensors released."""
    _HELD.pop(lora_id, None)
    manager = worker.model_runner.lora_manager
    return bool(lora_id in manager.list_adapters() and manager.remove_adapter(lora_id))

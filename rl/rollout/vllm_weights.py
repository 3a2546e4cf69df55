"""The HF tensors a vLLM push sends (``rl.rollout.vllm_engine``): which served vLLM module each HF
weight lands in, which are the MTP layer's, and the merged weights ``W + scale·B·A`` of a PEFT adapter
folded into the base shards, each in the dtype the served folder stores (FP8 block-quantized,
``glm5_mcore.checkpoint.fp8``, where it stores FP8).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

import torch

from glm5_mcore.checkpoint.fp8 import quantize_fp8_blocks
from glm5_mcore.checkpoint.hf_io import FP8, HFCheckpoint
from glm5_mcore.checkpoint.hf_names import hf_source
from glm5_mcore.config import GLM5Config
from glm5_mcore.lora.config import routed_expert_targets
from glm5_mcore.lora.peft import import_peft

MLA_UP_KV = "self_attn.kv_b_proj"
"""The HF module of Megatron's ``linear_kv_up_proj``. vLLM's MLA never applies a LoRA adapter on it:
decode multiplies by ``W_UK_T`` / ``W_UV``, split once from the base weight in
``MLAAttention.process_weights_after_loading`` (``mla_attention.py:1220-1327``), so in LoRA mode the
engine merges this module into the served weights (an in-place reload re-runs that split)."""


ROUTED_ADAPTER = re.compile(r"\.mlp\.experts\.")  # a routed expert's PEFT key (not ``mlp.shared_experts.``)
LORA_MODE_EXPERTS = ("adapters on the routed experts ({what}) cannot be served in vLLM's LoRA mode (vLLM 0.32's "
                     "FusedMoEWithLoRA takes a layout this push does not send): set rollout.engine_kwargs.merge: true")


def check_lora_targets(kwargs: dict, targets) -> None:
    """``rollout.engine_kwargs`` with the policy's ``lora.targets``, before Ray starts: LoRA mode
    (``merge`` false) with routed-expert targets is refused in one line naming ``merge: true``."""
    experts = routed_expert_targets(targets)
    if experts and not kwargs.get("merge", False):
        raise ValueError("lora.targets: " + LORA_MODE_EXPERTS.format(what=", ".join(experts)))


def is_mla_up_kv(hf_name: str) -> bool:
    return f".{MLA_UP_KV}." in hf_name


def default_push_threads() -> int:
    """CPU threads a merged push uses: the cores this process may run on, at most 32 (Ray actors run
    with ``OMP_NUM_THREADS=1``, which would leave the merge and the FP8 re-quantisation on one core)."""
    return max(1, min(32, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1))


HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def vllm_module_tensors(hf_name: str, n_experts: int) -> list[str]:
    """The HF tensors that land in the same vLLM module as ``hf_name`` (DeepSeek-V2/V3 model code):
    ``fused_qkv_a_proj`` = q_a_proj + kv_a_proj_with_mqa, ``gate_up_proj`` = gate + up, and one
    ``FusedMoE`` per layer = every routed expert's gate/up/down. vLLM's in-place reload rebuilds a
    module from what one ``reload_weights`` call brings, so a push must bring whole modules."""
    m = HF_LAYER.match(hf_name)
    if not m:
        return [hf_name]
    prefix, rest = f"model.layers.{m.group(1)}.", m.group(2)
    if rest in ("self_attn.q_a_proj.weight", "self_attn.kv_a_proj_with_mqa.weight"):
        return [prefix + "self_attn.q_a_proj.weight", prefix + "self_attn.kv_a_proj_with_mqa.weight"]
    g = re.match(r"^(mlp(?:\.shared_experts)?)\.(gate_proj|up_proj)\.weight$", rest)
    if g:
        return [f"{prefix}{g.group(1)}.{k}.weight" for k in ("gate_proj", "up_proj")]
    if re.match(r"^mlp\.experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight$", rest):
        return [f"{prefix}mlp.experts.{e}.{k}.weight" for e in range(n_experts) for k in ("gate_proj", "up_proj", "down_proj")]
    return [hf_name]


def is_mtp_tensor(hf_name: str, num_hidden_layers: int) -> bool:
    """An HF tensor of the MTP layer(s), ``model.layers.{num_hidden_layers + m}.*``: vLLM serves them in
    its speculative-decoding draft model, not in the decoder (whose loader skips them)."""
    m = HF_LAYER.match(hf_name)
    return bool(m) and int(m.group(1)) >= num_hidden_layers


@torch.no_grad()
def iter_merged_weights(hf_dir: str | Path, adapter_dir: Optional[str | Path], also: tuple = (),
                        max_bytes: int = 2 << 30, part: str = "decoder", merged=None):
    """HF name → tensor for vLLM's checkpoint-format loader, in dicts of whole decoder layers, at most
    ``max_bytes`` each unless one layer is larger: ``W + scale·B·A`` for every HF tensor the PEFT
    adapter in ``adapter_dir`` touches (GLU halves and per-expert names split as the one name table
    says; a no-op adapter, A or B all zero, touches nothing), the base value of the untouched tensors named in ``also`` (restoring what an earlier push
    changed; ``adapter_dir=None``: only those), and the base value of every other tensor of the vLLM
    modules these land in (``vllm_module_tensors``). Each comes in the dtype the folder stores it; an
    FP8-stored weight comes as e4m3 + ``weight_scale_inv`` blocks. ``part``: "decoder" (the served model),
    "mtp" (only the MTP layer's tensors, ``model.layers.{num_hidden_layers}.*``, for vLLM's MTP draft
    model: the adapter's MTP-layer modules merged the same way) or "all"; ``merged`` (HF name -> bool):
    only those of the adapter's tensors are merged (the rest stay base). Host memory is about one chunk."""
    glm5 = GLM5Config.from_hf_dir(hf_dir)
    L = glm5.num_hidden_layers
    state = import_peft(str(adapter_dir), L) if adapter_dir is not None else None
    base = HFCheckpoint(hf_dir)
    deltas: dict[str, tuple[str, int]] = {}  # HF name -> (Megatron module, GLU half or -1)
    if part not in ("decoder", "mtp", "all"):
        raise ValueError(f"part={part!r}: one of 'decoder', 'mtp', 'all'")
    keep = (lambda h: True) if part == "all" else (lambda h: is_mtp_tensor(h, L) == (part == "mtp"))
    for module in (state.modules() if state else []):
        if not (state.A[module].any() and state.B[module].any()):
            continue  # a no-op adapter (B zero at init, a family left untouched): its weights are not pushed
        src = hf_source(module + ".weight", L)
        for i, h in enumerate(src.names):
            if keep(h) and (merged is None or merged(h)):
                deltas[h] = (module, i if src.is_glu else -1)
    names = {n for h in (*deltas, *(h for h in also if keep(h)))
             for n in vllm_module_tensors(h, glm5.n_routed_experts)}
    layer_of = {h: int(m.group(1)) if (m := HF_LAYER.match(h)) else -1 for h in names}
    chunk: dict[str, torch.Tensor] = {}
    size = 0
    for layer in sorted(set(layer_of.values())):
        parts = {}
        for h in sorted(n for n in names if layer_of[n] == layer):
            w = base.get(h).float()
            if h in deltas:
                module, half = deltas[h]
                d = state.delta(module)
                w = w + (d.chunk(2, 0)[half] if half >= 0 else d)
            parts[h] = w
        out = _as_stored(base, parts)
        chunk.update(out)
        size += sum(t.numel() * t.element_size() for t in out.values())
        if size >= max_bytes:
            yield chunk
            chunk, size = {}, 0
    if chunk:
        yield chunk


def merged_weights(hf_dir: str | Path, adapter_dir: str | Path, also: tuple = (),
                   part: str = "decoder") -> dict[str, torch.Tensor]:
    """All of ``iter_merged_weights`` in one dict."""
    out: dict[str, torch.Tensor] = {}
    for chunk in iter_merged_weights(hf_dir, adapter_dir, also, part=part):
        out.update(chunk)
    return out


def _as_stored(base, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor in the dtype ``base`` (an ``HFCheckpoint``) stores it; FP8 as e4m3 + block scales."""
    out = {}
    for h, w in tensors.items():
        stored = base.info(h)[1]
        if stored in FP8:
            out[h], out[h + "_scale_inv"] = quantize_fp8_blocks(w)
        else:
            out[h] = w.to(stored).contiguous()
    return out

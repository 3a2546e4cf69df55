"""The HF tensors a merged vLLM push sends (``rl.rollout.vllm_engine``): which served vLLM module each HF
weight lands in, which are the MTP layer's, and the merged weights ``W + scale·B·A`` of a PEFT adapter
folded into the base shards, each in the dtype the served folder stores (FP8 block-quantized,
``glm5_mcore.checkpoint.fp8``, where it stores FP8).

A merged weight keeps only what its dtype can hold of the delta: re-quantizing ``dequant(W_fp8) + ΔW`` to e4m3
gives back the same bytes wherever ``|ΔW|`` is under half an e4m3 step (3-6 % of ``|W|``), so a small adapter is
mostly rounded away. Each push measures, per LoRA family, the fraction of the delta the served weights keep
(``merged_delta_kept``: the least-squares slope of the served change on ``ΔW``, ``⟨Ŵ − W, ΔW⟩ / ‖ΔW‖²``; 1 exact,
0 rounded away) and refuses, in one line, an FP8 push whose decoder family keeps less than ``KEPT_MIN`` (the MTP
draft's only costs acceptance: reported, not refused). LoRA mode (``rl.rollout.vllm_lora``) serves the delta as
a separate product instead.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Optional

import torch

from glm5_mcore.checkpoint.fp8 import quantize_fp8_blocks
from glm5_mcore.checkpoint.hf_io import FP8, HFCheckpoint, dequantize_fp8_blocks
from glm5_mcore.checkpoint.hf_names import hf_source
from glm5_mcore.config import GLM5Config
from glm5_mcore.lora.config import family_of
from glm5_mcore.lora.peft import import_peft
from glm5_mcore.lora.state import AdapterState

KEPT_MIN = 0.9
"""A merged push into FP8-stored decoder weights is refused below this kept fraction (``merged_delta_kept``)."""


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
def iter_merged_weights(hf_dir: str | Path, adapter, also: tuple = (), max_bytes: int = 2 << 30,
                        part: str = "decoder", merged=None, kept: Optional[dict] = None, kept_min: float = KEPT_MIN):
    """HF name → tensor for vLLM's checkpoint-format loader, in dicts of whole decoder layers, at most
    ``max_bytes`` each unless one layer is larger: ``W + scale·B·A`` for every HF tensor the adapter touches
    (``adapter``: an ``AdapterState``, a PEFT folder, or None; GLU halves and per-expert names split as the one name
    table says; a no-op adapter, A or B all zero, touches nothing), the base value of the untouched tensors named
    in ``also`` (restoring what an earlier push changed; ``adapter=None``: only those), and the base value of every
    other tensor of the vLLM modules these land in (``vllm_module_tensors``). Each comes in the dtype the folder
    stores it; an FP8-stored weight comes as e4m3 + ``weight_scale_inv`` blocks. ``part``: "decoder" (the served
    model), "mtp" (only the MTP layer's tensors, ``model.layers.{num_hidden_layers}.*``, for vLLM's MTP draft
    model: the adapter's MTP-layer modules merged the same way) or "all"; ``merged`` (HF name -> bool): only
    those of the adapter's tensors are merged (the rest stay base). ``kept``: filled with {family: [⟨Ŵ − W, ΔW⟩,
    ‖ΔW‖², fp8]} (``merged_delta_kept``); a chunk whose FP8 decoder family keeps less than ``kept_min`` so far is
    refused before it is yielded. Host memory is about one chunk."""
    glm5 = GLM5Config.from_hf_dir(hf_dir)
    L = glm5.num_hidden_layers
    state = adapter if adapter is None or isinstance(adapter, AdapterState) else import_peft(str(adapter), L)
    base = HFCheckpoint(hf_dir)
    if part not in ("decoder", "mtp", "all"):
        raise ValueError(f"part={part!r}: one of 'decoder', 'mtp', 'all'")
    keep = (lambda h: True) if part == "all" else (lambda h: is_mtp_tensor(h, L) == (part == "mtp"))
    deltas = adapted_tensors(state, L, lambda h: keep(h) and (merged is None or merged(h))) if state else {}
    names = {n for h in (*deltas, *(h for h in also if keep(h)))
             for n in vllm_module_tensors(h, glm5.n_routed_experts)}
    layer_of = {h: int(m.group(1)) if (m := HF_LAYER.match(h)) else -1 for h in names}
    kept = {} if kept is None else kept
    chunk: dict[str, torch.Tensor] = {}
    size = 0
    for layer in sorted(set(layer_of.values())):
        parts, moved = {}, {}
        for h in sorted(n for n in names if layer_of[n] == layer):
            w = base.get(h).float()
            if h in deltas:
                module, half = deltas[h]
                d = state.delta(module)
                moved[h] = (("draft/" if is_mtp_tensor(h, L) else "") + (family_of(module) or module),
                            w, d.chunk(2, 0)[half] if half >= 0 else d)
                w = w + moved[h][2]
            parts[h] = w
        out = _as_stored(base, parts)
        _account(kept, base, out, moved)
        low = {f: v[0] / v[1] for f, v in kept.items() if v[2] and not f.startswith("draft/") and v[1] > 0
               and v[0] / v[1] < kept_min}
        if low:
            fam, frac = min(low.items(), key=lambda kv: kv[1])
            raise ValueError(f"merged FP8 push: {fam} keeps {frac:.1%} of the adapter's delta (< {kept_min:.0%}): "
                             "re-quantizing W + ΔW to e4m3 rounds a small adapter away; serve it in LoRA mode "
                             f"(rollout.engine_kwargs.merge: false) or take {fam} out of lora.targets")
        chunk.update(out)
        size += sum(t.numel() * t.element_size() for t in out.values())
        if size >= max_bytes:
            yield chunk
            chunk, size = {}, 0
    if chunk:
        yield chunk


def adapted_tensors(state: AdapterState, num_hidden_layers: int, keep=lambda h: True) -> dict[str, tuple[str, int]]:
    """HF name → (Megatron module, GLU half or -1) of every HF weight a non-zero adapter of ``state`` changes
    (a no-op adapter, A or B all zero, changes nothing), those ``keep(name)`` accepts."""
    out = {}
    for module in state.modules():
        if not (state.A[module].any() and state.B[module].any()):
            continue
        src = hf_source(module + ".weight", num_hidden_layers)
        for i, h in enumerate(src.names):
            if keep(h):
                out[h] = (module, i if src.is_glu else -1)
    return out


def merged_delta_kept(kept: dict) -> dict[str, float]:
    """``iter_merged_weights``' ``kept`` as {family: fraction of the adapter's delta the served weights keep}."""
    return {f: v[0] / v[1] for f, v in sorted(kept.items()) if v[1] > 0}


def _account(kept: dict, base, out: dict, moved: dict) -> None:
    """Add each merged tensor's ⟨Ŵ − W, ΔW⟩ and ‖ΔW‖² (Ŵ: what the stored dtype holds of W + ΔW) to its family."""
    for h, (family, w, d) in moved.items():
        fp8 = h + "_scale_inv" in out
        served = dequantize_fp8_blocks(out[h], out[h + "_scale_inv"], base.block) if fp8 else out[h].float()
        acc = kept.setdefault(family, [0.0, 0.0, False])
        acc[0] += float(((served - w).double() * d.double()).sum())
        acc[1] += float((d.double() ** 2).sum())
        acc[2] = acc[2] or fp8


def merged_weights(hf_dir: str | Path, adapter, also: tuple = (), part: str = "decoder",
                   kept: Optional[dict] = None, kept_min: float = KEPT_MIN) -> dict[str, torch.Tensor]:
    """All of ``iter_merged_weights`` in one dict."""
    out: dict[str, torch.Tensor] = {}
    for chunk in iter_merged_weights(hf_dir, adapter, also, part=part, kept=kept, kept_min=kept_min):
        out.update(chunk)
    return out


def _as_stored(base, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each tensor in the dtype ``base`` (an ``HFCheckpoint``) stores it; FP8 as e4m3 + block scales."""
    out = {}
    for h, w in tensors.items():
        stored = base.info(h)[1]
        if stored in FP8:  # in the folder's own block size (its config's weight_block_size)
            out[h], out[h + "_scale_inv"] = quantize_fp8_blocks(w, base.block)
        else:
            out[h] = w.to(stored).contiguous()
    return out

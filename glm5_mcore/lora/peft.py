"""HF PEFT adapters for GLM-5 ↔ our ``AdapterState`` (Megatron names, full tensors).

Written so that ``peft`` 0.21 on transformers 5 loads it into ``GlmMoeDsaForCausalLM`` with no
missing or unexpected keys:

- MLA and indexer linears are ``target_modules`` (``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``,
  ``kv_b_proj``, ``o_proj``, ``wq_b``, ``wk``, ``weights_proj``).
- Dense-MLP and shared-expert ``gate_proj`` / ``up_proj`` / ``down_proj`` are ``target_parameters`` on
  their ``.weight`` (``mlp.gate_proj.weight``, ``shared_experts.up_proj.weight``, ...): as
  ``target_modules`` peft rewrites them into the fused-expert parameters and drops them silently.
  Megatron's fused ``linear_fc1`` adapter (A, B) becomes gate (A, B[:I]) and up (A, B[I:]) exactly.
- Routed experts are ``target_parameters`` ``experts.gate_up_proj`` / ``experts.down_proj`` in the form
  peft saves: ``lora_A [E·r, in]`` expert-major, ``lora_B [out, r·E]`` with column ``k·E + e`` for
  rank ``k`` of expert ``e``; when both are adapted, gate_up_proj is the inner wrapper
  (``experts.base_layer.lora_*``) and down_proj the outer (``experts.lora_*``).

Import accepts that form, per-expert keys (``experts.{e}.gate_proj``), and gate/up pairs with
different A (they become one fc1 adapter of rank r_gate + r_up, block-diagonal B). The MTP layer has
no HF module, so its adapters are not exported.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save, save_file

from glm5_mcore.lora.state import AdapterState
from glm5_mcore.checkpoint.atomic import output_dir
from glm5_mcore.checkpoint.hf_names import LAYER_RULES, hf_source
from glm5_mcore.lora.state import adapter_files, load_adapter_tensors

PREFIX = "base_model.model."
TARGET_MODULES = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "wq_b", "wk", "weights_proj")
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def _target_parameter(hf_weight: str) -> str:
    """The ``target_parameters`` entry of a dense / shared-expert MLP weight."""
    parts = hf_weight.split(".")
    return ".".join(parts[-3:])  # "mlp.gate_proj.weight" / "shared_experts.gate_proj.weight"


def export_peft(state: AdapterState, num_hidden_layers: int, n_experts: int, out: str | Path,
                base_model: str = "", inputs: tuple = (), overwrite: bool = False, include_mtp: bool = False) -> Path:
    """Write ``adapter_config.json`` + ``adapter_model.safetensors`` (HF PEFT, ``peft_tensors``) for ``state``."""
    tensors, config = peft_tensors(state, num_hidden_layers, n_experts, base_model, include_mtp)
    with output_dir(out, "lora export", inputs, overwrite) as tmp:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return Path(out)


def peft_files(state: AdapterState, num_hidden_layers: int, n_experts: int, base_model: str = "",
               include_mtp: bool = False, dtype: Optional[torch.dtype] = None) -> dict[str, bytes]:
    """``export_peft``'s two files as bytes, in memory (what an RL push carries): {"adapter_config.json",
    "adapter_model.safetensors"}; ``dtype``: the tensors cast to it (bf16: what a bf16 engine computes with,
    half the bytes of the fp32 master copy)."""
    tensors, config = peft_tensors(state, num_hidden_layers, n_experts, base_model, include_mtp)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    return {"adapter_config.json": json.dumps(config, indent=2).encode(),
            "adapter_model.safetensors": save(tensors, metadata={"format": "pt"})}


def peft_tensors(state: AdapterState, num_hidden_layers: int, n_experts: int, base_model: str = "",
                 include_mtp: bool = False) -> tuple[dict[str, torch.Tensor], dict]:
    """``state`` as HF PEFT: (tensors by PEFT key, ``adapter_config.json`` as a dict).

    MTP-layer adapters are left out (transformers builds no module for the MTP layer) unless
    ``include_mtp``: then they are written under the release's ``model.layers.{num_hidden_layers}.*``
    names, as a serving engine that loads the MTP layer as a draft model (vLLM, SGLang) names it."""
    tensors: dict[str, torch.Tensor] = {}
    ranks: dict[str, tuple[int, float]] = {}  # peft key (module or param) -> (r, alpha)
    target_modules, target_params = set(), set()
    experts: dict[tuple[str, str], dict[int, tuple[torch.Tensor, torch.Tensor, float]]] = {}

    for module in state.modules():
        names = hf_source(module + ".weight", num_hidden_layers).names
        layer = int(re.match(r"model\.layers\.(\d+)\.", names[0]).group(1))
        if layer >= num_hidden_layers and not include_mtp:
            continue  # MTP: transformers builds no module for it
        a, b, s = state.A[module].float(), state.B[module].float(), state.scale[module]
        r = a.shape[0]
        m = _EXPERT.match(names[0])
        if m:
            kind = "down_proj" if m.group(3) == "down_proj" else "gate_up_proj"
            experts.setdefault((m.group(1), kind), {})[int(m.group(2))] = (a, b, s)
            continue
        halves = b.chunk(2, dim=0) if len(names) == 2 else (b,)
        for hf_w, bh in zip(names, halves):
            hf_mod = hf_w[: -len(".weight")]
            tensors[f"{PREFIX}{hf_mod}.lora_A.weight"] = a.clone()
            tensors[f"{PREFIX}{hf_mod}.lora_B.weight"] = bh.contiguous()
            if hf_mod.rsplit(".", 1)[-1] in TARGET_MODULES:
                target_modules.add(hf_mod.rsplit(".", 1)[-1])
                ranks[hf_mod] = (r, s * r)
            else:
                target_params.add(_target_parameter(hf_w))
                ranks[hf_w] = (r, s * r)

    by_layer: dict[str, set[str]] = {}
    for (prefix, kind) in experts:
        by_layer.setdefault(prefix, set()).add(kind)
    for (prefix, kind), per in experts.items():
        missing = [e for e in range(n_experts) if e not in per]
        if missing:
            raise ValueError(f"{prefix}: routed-expert adapters exist for some experts but not {missing[:5]}; "
                             "peft's fused form needs all")
        rs = {per[e][0].shape[0] for e in per}
        ss = {per[e][2] for e in per}
        if len(rs) != 1 or len(ss) != 1:
            raise ValueError(f"{prefix}.{kind}: experts have different ranks/scales, peft's fused form needs one")
        r, s = rs.pop(), ss.pop()
        a = torch.cat([per[e][0] for e in range(n_experts)], 0)  # [E*r, in]
        b = torch.stack([per[e][1] for e in range(n_experts)], -1).reshape(per[0][1].shape[0], -1)  # [out, r*E]
        inner = kind == "gate_up_proj" and len(by_layer[prefix]) == 2
        mod = f"{prefix}.base_layer" if inner else prefix
        tensors[f"{PREFIX}{mod}.lora_A.weight"] = a.contiguous()
        tensors[f"{PREFIX}{mod}.lora_B.weight"] = b.contiguous()
        target_params.add(f"experts.{kind}")
        ranks[f"{prefix}.{kind}"] = (r, s * r)

    if not tensors:
        raise ValueError("the adapter has no module that exists in transformers' GLM-5")
    counts: dict[tuple[int, float], int] = {}
    for v in ranks.values():
        counts[v] = counts.get(v, 0) + 1
    r0, alpha0 = max(counts, key=counts.get)
    rank_pattern = {re.escape(k): v[0] for k, v in ranks.items() if v[0] != r0}
    alpha_pattern = {re.escape(k): v[1] for k, v in ranks.items() if v[1] != alpha0}
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": r0, "lora_alpha": alpha0, "lora_dropout": 0.0, "bias": "none", "use_rslora": False,
        "use_dora": False, "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True,
        "target_modules": sorted(target_modules), "target_parameters": sorted(target_params),
        "rank_pattern": rank_pattern, "alpha_pattern": alpha_pattern, "modules_to_save": None,
        "layers_to_transform": None, "layers_pattern": None,
    }
    return tensors, config


def _reverse_rules() -> dict[str, tuple[str, Optional[str]]]:
    """HF module suffix within a layer -> (Megatron module suffix, "gate" / "up" / None)."""
    rev = {}
    for mcore, hf in LAYER_RULES:
        if not mcore.endswith(".weight") or "{e}" in mcore:
            continue
        mod = mcore[: -len(".weight")]
        if isinstance(hf, str):
            rev[hf[: -len(".weight")]] = (mod, None)
        else:
            rev[hf[0][: -len(".weight")]] = (mod, "gate")
            rev[hf[1][: -len(".weight")]] = (mod, "up")
    return rev


def _pattern_value(patterns: dict, key: str, default):
    for pat, v in patterns.items():
        if re.match(rf"(.*\.)?({pat})$", key):
            return v
    return default


def import_peft(peft_dir: str | Path, num_hidden_layers: int) -> AdapterState:
    """An HF PEFT LoRA adapter folder for GLM-5 as an ``AdapterState`` (Megatron names, full tensors)."""
    cfg_path, st_path, cfg = adapter_files(peft_dir, "an HF PEFT adapter")
    return peft_state(cfg, load_adapter_tensors(st_path), num_hidden_layers, cfg_path, st_path)


def peft_state(cfg: dict, raw: dict[str, torch.Tensor], num_hidden_layers: int, cfg_path="adapter_config.json",
               st_path="adapter_model.safetensors") -> AdapterState:
    """An HF PEFT adapter in memory (its config, its tensors by PEFT key) as an ``AdapterState``; errors name
    ``cfg_path`` / ``st_path``."""
    if not isinstance(cfg, dict) or "r" not in cfg or "lora_alpha" not in cfg:
        raise ValueError(f"{cfg_path}: not an HF PEFT LoRA config (needs 'r' and 'lora_alpha')")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r}, only LORA is supported")
    for flag in ("use_dora", "fan_in_fan_out"):
        if cfg.get(flag):
            raise ValueError(f"{cfg_path}: {flag}=true is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{cfg_path}: bias={cfg['bias']!r} is not supported (only 'none')")
    r0, alpha0 = int(cfg["r"]), float(cfg["lora_alpha"])
    rslora = bool(cfg.get("use_rslora"))
    targets = set(cfg.get("target_parameters") or [])

    def scale(key: str, r: int) -> float:
        alpha = float(_pattern_value(cfg.get("alpha_pattern") or {}, key, alpha0))
        return alpha / (r ** 0.5 if rslora else r)

    pairs: dict[str, dict] = {}
    for k in raw:
        m = re.match(r"^(?:base_model\.model\.)?(.+)\.lora_A(?:\.[^.]+)?\.weight$", k)
        if not m:
            if ".lora_B" not in k:
                raise ValueError(f"{st_path}: tensor {k} is not a LoRA A/B weight")
            continue
        mod = m.group(1)
        bkey = k.replace(".lora_A", ".lora_B")
        if bkey not in raw:
            raise ValueError(f"{st_path}: {k} has no matching {bkey}")
        pairs[mod] = {"A": raw[k].float(), "B": raw[bkey].float()}

    rev = _reverse_rules()
    state = AdapterState()
    fc1: dict[str, dict[str, tuple]] = {}  # Megatron fc1 module -> {"gate"/"up": (A, B, s)}

    def put(layer: int, msuffix: str, part: Optional[str], a, b, s):
        mod = (f"decoder.layers.{layer}.{msuffix}" if layer < num_hidden_layers
               else f"mtp.layers.{layer - num_hidden_layers}.mtp_model_layer.{msuffix}")
        if part is None:
            state.A[mod], state.B[mod], state.scale[mod] = a, b, s
        else:
            fc1.setdefault(mod, {})[part] = (a, b, s)

    for mod, t in pairs.items():
        m = re.match(r"^model\.layers\.(\d+)\.(.+)$", mod)
        if not m:
            raise ValueError(f"{st_path}: LoRA module {mod} is not inside a GLM-5 decoder layer")
        layer, rest = int(m.group(1)), m.group(2)
        a, b = t["A"], t["B"]
        if rest in ("mlp.experts", "mlp.experts.base_layer"):
            both = {"experts.gate_up_proj", "experts.down_proj"} <= {x if x.startswith("experts.") else f"experts.{x}"
                                                                      for x in targets}
            if both:
                kind = "gate_up_proj" if rest.endswith("base_layer") else "down_proj"
            else:
                kind = "gate_up_proj" if any(x.endswith("gate_up_proj") for x in targets) else "down_proj"
            out_f, r_total = b.shape[0], a.shape[0]
            key = f"model.layers.{layer}.mlp.experts.{kind}"
            r = int(_pattern_value(cfg.get("rank_pattern") or {}, key, r0))
            if r_total % r:
                raise ValueError(f"{st_path}: {mod} lora_A has {r_total} rows, not a multiple of r={r}")
            n_exp = r_total // r
            a_e = a.reshape(n_exp, r, a.shape[-1])
            b_e = b.reshape(out_f, r, n_exp)
            s = scale(key, r)
            msuffix = "mlp.experts.local_experts.{e}." + ("linear_fc1" if kind == "gate_up_proj" else "linear_fc2")
            for e in range(n_exp):
                put(layer, msuffix.format(e=e), None, a_e[e].contiguous(), b_e[:, :, e].contiguous(), s)
            continue
        em = re.match(r"^mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)$", rest)
        if em:
            e, kind = int(em.group(1)), em.group(2)
            s = scale(mod, a.shape[0])
            if kind == "down_proj":
                put(layer, f"mlp.experts.local_experts.{e}.linear_fc2", None, a, b, s)
            else:
                put(layer, f"mlp.experts.local_experts.{e}.linear_fc1", "gate" if kind == "gate_proj" else "up",
                    a, b, s)
            continue
        if rest not in rev:
            raise ValueError(f"{st_path}: LoRA module {mod} has no Megatron counterpart in the GLM-5 name table")
        msuffix, part = rev[rest]
        key = mod + (".weight" if rest.startswith("mlp.") else "")
        put(layer, msuffix, part, a, b, scale(key, a.shape[0]))

    for mod, parts in fc1.items():
        state.A[mod], state.B[mod], state.scale[mod] = fc1_from_halves(parts.get("gate"), parts.get("up"))
    return state


def fc1_from_halves(gate: Optional[tuple], up: Optional[tuple]) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One Megatron ``linear_fc1`` adapter (A, B, scale) from separate gate / up adapters ``(A [r, in],
    B [I, r], scale)`` (either may be None: that half gets no update): with one shared A, B stacked; else
    rank r_gate + r_up, A stacked, B block-diagonal with up's scale folded into its block."""
    ref = gate or up
    rows = ref[1].shape[0]
    if gate and up and torch.equal(gate[0], up[0]) and gate[2] == up[2]:
        return gate[0], torch.cat([gate[1], up[1]]), gate[2]
    s = ref[2]
    a = torch.cat([half[0] for half in (gate, up) if half is not None])
    b = torch.zeros(2 * rows, a.shape[0])
    col = 0
    for i, half in enumerate((gate, up)):
        if half is None:
            continue
        r = half[0].shape[0]
        b[i * rows:(i + 1) * rows, col:col + r] = half[1] * (half[2] / s)
        col += r
    return a, b, s

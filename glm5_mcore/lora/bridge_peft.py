"""Megatron-Bridge LoRA (PEFT) checkpoints as our ``AdapterState``, for ``glm5 lora export``.

Bridge's PEFT training saves the adapters only (``training/checkpointing.py``:
``apply_peft_adapter_filter_to_state_dict`` keeps the keys with ``.adapter.``): ``iter_N/`` is a
torch_dist checkpoint holding, for each adapted Megatron linear ``{module}`` (``peft/utils.py``
``ParallelLinearAdapter``; scale ``alpha / r`` in its forward)::

    {module}.adapter.linear_in.weight    A [r, in]
    {module}.adapter.linear_out.weight   B [out, r]   (linear_fc1: gate rows, then up rows)

and ``run_config.yaml`` with the ``peft`` section (``_target_`` LoRA / CanonicalLoRA, ``dim``,
``alpha``, ``target_modules``) beside ``model``, and ``checkpoint.pretrained_checkpoint``: the base
weights the adapters were trained on (Bridge's ``examples/peft/merge_lora.py`` reads it there too).

Routed experts (``mlp.experts.experts.linear_fc{1,2}``: Megatron-Core's TEGroupedMLP and
SequentialMLP give the same keys, ``experts/moe/experts.py`` ``sharded_state_dict``) carry the global
expert axis first: ``A [E, r, in]``, ``B [E, out, r]`` — one adapter per expert
(``share_expert_adapters=False``) or Bridge's default shared adapter stored once per expert; 2-D in
its legacy shared layout and ``[1, ...]`` for a side shared across experts
(``experts_shared_outer_loras``): those are used by every expert. With ``singleton_local_shards`` the
expert index is in the key (``mlp.experts.experts.{e}.linear_fc1``) and the SwiGLU halves of B are stored as
``linear_out.weight_w`` / ``_v``. CanonicalLoRA's ``linear_fc1.adapter.adapter_gate`` /
``adapter_up`` (gate and up with their own A) become one fc1 adapter of rank r_gate + r_up.
Everything else (DoRA, LoRA on the router, embeddings or output layer) is refused naming it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from glm5_mcore.checkpoint import megatron_lm
from glm5_mcore.config import GLM5Config
from glm5_mcore.lora.config import family_of
from glm5_mcore.lora.peft import fc1_from_halves
from glm5_mcore.lora.state import AdapterState

_KEY = re.compile(r"^(?P<mod>.+?)\.adapter\.(?:(?P<half>adapter_gate|adapter_up)\.)?"
                  r"linear_(?P<side>in|out)\.weight(?P<sw>_w|_v)?$")
_GROUPED = re.compile(r"^(?P<pre>.+\.mlp\.experts)(?:\.experts)?\.(?:(?P<e>\d+)\.)?(?P<fc>linear_fc[12])$")
_LORA_TARGETS = ("megatron.bridge.peft.lora.LoRA", "megatron.bridge.peft.canonical_lora.CanonicalLoRA")


@dataclass
class ForeignAdapter:
    """A Bridge PEFT checkpoint read: the adapter, the model config, where the base weights are."""

    state: AdapterState
    config: GLM5Config
    base: Optional[str]  # run_config.yaml checkpoint.pretrained_checkpoint
    base_model: str  # the HF model it names (tokenizer.tokenizer_model), for adapter_config.json
    path: Path


def adapter_keys(keys) -> list[str]:
    return sorted(k for k in keys if ".adapter." in k and not k.startswith("optimizer."))


def _read_tensors(path: Path, keys: list[str]) -> dict[str, torch.Tensor]:
    """Full (unsharded) tensors of ``keys`` from a torch_dist checkpoint, whatever its TP/EP layout."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    sd = {k: torch.empty(tuple(md[k].size), dtype=md[k].properties.dtype) for k in keys}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=FileSystemReader(str(path)), no_dist=True)
    return sd


def _peft_section(rc_file: Optional[Path], path: Path) -> dict:
    import yaml

    if rc_file is None:
        raise ValueError(f"{path}: LoRA adapter tensors but no run_config.yaml (their alpha is in its 'peft' "
                         "section); only Megatron-Bridge PEFT checkpoints are read")
    rc = yaml.safe_load(rc_file.read_text()) or {}
    peft = rc.get("peft")
    if not isinstance(peft, dict):
        raise ValueError(f"{rc_file}: no 'peft' section, but {path} holds LoRA adapter tensors")
    target = str(peft.get("_target_", ""))
    if target not in _LORA_TARGETS:
        raise ValueError(f"{rc_file}: peft._target_ {target!r} is not read (only LoRA and CanonicalLoRA"
                         f"{'; DoRA has magnitude vectors HF PEFT LoRA cannot hold' if 'DoRA' in target else ''})")
    if "alpha" not in peft:
        raise ValueError(f"{rc_file}: peft.alpha is missing")
    return rc


def _check_pair(key: str, a: torch.Tensor, b: torch.Tensor, where: Path) -> None:
    if a.dim() != b.dim() or a.dim() not in (2, 3) or a.shape[-2] != b.shape[-1]:
        raise ValueError(f"{where}: tensor {key}: A {tuple(a.shape)} and B {tuple(b.shape)} are not a LoRA pair "
                         "(A [r, in], B [out, r], experts with a leading expert axis)")


def read_bridge_adapter(root: str | Path, iteration: Optional[int] = None) -> ForeignAdapter:
    """The LoRA adapter of a Megatron-Bridge PEFT checkpoint (``root`` or an ``iter_N`` folder) under our
    Megatron module names, full tensors, ``scale = alpha / r``. Errors name the file and tensor."""
    path = megatron_lm.model_path(root, iteration)
    keys = adapter_keys(megatron_lm.stored_keys(path))
    if not keys:
        raise ValueError(f"{path}: a {megatron_lm.checkpoint_kind(path)} checkpoint with no LoRA adapter in it "
                         "(no '*.adapter.linear_in.weight' tensor); `glm5 convert mcore-to-hf` writes its weights")
    rc_file = megatron_lm.run_config_file(path)
    rc = _peft_section(rc_file, path)
    alpha = float(rc["peft"]["alpha"])
    own, where = megatron_lm.own_megatron_config(path)
    cfg = GLM5Config.from_hf_dict(megatron_lm.hf_dict_from_megatron(own), source=where)
    raw = _read_tensors(path, keys)

    # (module, half) -> {"in": A, "out": B}; half None / "gate" / "up"
    pairs: dict[tuple[str, Optional[str]], dict[str, torch.Tensor]] = {}
    for k in keys:
        m = _KEY.match(k)
        if not m:
            raise ValueError(f"{path}: tensor {k}: not a LoRA linear_in / linear_out weight "
                             "(only LoRA and CanonicalLoRA adapters are read)")
        slot = pairs.setdefault((m["mod"], m["half"] and m["half"][len("adapter_"):]), {})
        t = raw[k].float()
        if m["sw"]:
            slot.setdefault("out_halves", {})[m["sw"]] = t
        else:
            slot[m["side"]] = t
    L, E = cfg.num_hidden_layers, cfg.n_routed_experts
    state, halves = AdapterState(), {}
    for (mod, half), t in sorted(pairs.items(), key=lambda x: (x[0][0], x[0][1] or "")):
        if "out_halves" in t:
            sw = t.pop("out_halves")
            if set(sw) != {"_w", "_v"}:
                raise ValueError(f"{path}: tensor {mod}.adapter.linear_out.weight: only one SwiGLU half stored")
            t["out"] = torch.cat([sw["_w"], sw["_v"]], dim=-2)
        if set(t) != {"in", "out"}:
            raise ValueError(f"{path}: tensor {mod}.adapter...linear_{'in' if 'in' not in t else 'out'}.weight "
                             "is missing (a LoRA adapter needs both)")
        a, b = t["in"], t["out"]
        _check_pair(mod, a, b, path)
        g = _GROUPED.match(mod)
        if g and ".local_experts." not in mod:
            if g["e"] is not None:
                targets = {int(g["e"]): (a, b)}
            else:
                n = max(a.shape[0] if a.dim() == 3 else 1, b.shape[0] if b.dim() == 3 else 1)
                if n not in (1, E):
                    raise ValueError(f"{path}: tensor {mod}.adapter.linear_in.weight: expert axis {n}, "
                                     f"the model has {E} routed experts")
                pick = (lambda x, e: x if x.dim() == 2 else x[e if x.shape[0] > 1 else 0])
                targets = {e: (pick(a, e), pick(b, e)) for e in range(E)}
            names = {e: f"{g['pre']}.local_experts.{e}.{g['fc']}" for e in targets}
        else:
            if a.dim() != 2:
                raise ValueError(f"{path}: tensor {mod}.adapter.linear_in.weight: {a.dim()}-D outside the routed experts")
            targets, names = {None: (a, b)}, {None: mod}
        for e, (ae, be) in targets.items():
            name = names[e]
            lm = re.match(r"^(decoder\.layers\.(\d+)\.|mtp\.layers\.(\d+)\.mtp_model_layer\.)", name)
            if family_of(name) is None or not lm or (lm[2] is not None and int(lm[2]) >= L):
                raise ValueError(f"{path}: tensor {mod}.adapter.linear_in.weight: LoRA on {mod} has no counterpart "
                                 "among GLM-5's LoRA families (MLA, indexer, MLP / shared / routed expert linears)")
            if half is not None:
                if not name.endswith("linear_fc1"):
                    raise ValueError(f"{path}: tensor {mod}.adapter.adapter_{half}: gate/up halves only exist on linear_fc1")
                halves.setdefault(name, {})[half] = (ae.contiguous(), be.contiguous(), alpha / ae.shape[0])
                continue
            state.A[name], state.B[name], state.scale[name] = ae.contiguous(), be.contiguous(), alpha / ae.shape[0]
    for name, parts in halves.items():
        if name in state.A:
            raise ValueError(f"{path}: {name} has both a fused LoRA adapter and CanonicalLoRA gate/up halves")
        state.A[name], state.B[name], state.scale[name] = fc1_from_halves(parts.get("gate"), parts.get("up"))
    ck = rc.get("checkpoint") or {}
    tok = rc.get("tokenizer") or {}
    base_model = tok.get("tokenizer_model") if isinstance(tok.get("tokenizer_model"), str) else ""
    return ForeignAdapter(state, cfg, ck.get("pretrained_checkpoint"), base_model or "", path)

"""LoRA adapters as layout-free state: full tensors under global Megatron module names.

An ``AdapterState`` maps a global module path (``decoder.layers.{i}...``, experts by global index) to
its full (TP-gathered) ``A [r, in]``, ``B [out, r]`` and ``scale``. It is what the checkpoint stores
under ``iter_N/adapters/{name}/`` (``adapter_model.safetensors`` with keys ``{module}.lora_A`` /
``{module}.lora_B`` + ``adapter_config.json`` with the LoRA config and per-module scale), what the
PEFT exporter reads, and what any TP/EP/PP layout loads by slicing its own shards.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from safetensors.torch import load_file, save_file

from glm5_mcore.checkpoint.atomic import atomic_dir
from glm5_mcore.checkpoint.manifest import verify_under
from glm5_mcore.lora.config import LoRAConfig, family_of
from glm5_mcore.lora.apply import global_module_name, lora_layers
from glm5_mcore.lora.grouped import attach_any, linear_targets
from glm5_mcore.model.parallel import rank_offsets

FORMAT = "glm5-mcore-lora-1"


@dataclass
class AdapterState:
    """Full adapter tensors by global Megatron module path."""

    A: dict[str, torch.Tensor] = field(default_factory=dict)
    B: dict[str, torch.Tensor] = field(default_factory=dict)
    scale: dict[str, float] = field(default_factory=dict)
    config: Optional[LoRAConfig] = None

    def modules(self) -> list[str]:
        return list(self.A)

    def delta(self, module: str) -> torch.Tensor:
        """``scale · B·A`` in fp32, the full-weight update of ``module``."""
        return (self.B[module].float() @ self.A[module].float()) * self.scale[module]


def gather_adapter(model, name: str) -> Optional[AdapterState]:
    """Collect adapter ``name`` from every rank; the full state on rank 0 (None elsewhere)."""
    local = AdapterState()
    for _, _, lora in lora_layers(model):
        if name not in lora.A:
            continue
        a, b = lora.full(name)  # collective over the module's TP group
        local.A[lora.module_name], local.B[lora.module_name] = a.cpu(), b.cpu()
        local.scale[lora.module_name] = lora.scale[name]
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return local
    parts = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object((local.A, local.B, local.scale), parts, dst=0)
    if dist.get_rank() != 0:
        return None
    out = AdapterState()
    for a, b, s in parts:  # TP / DP replicas hold identical copies: keep the first
        for k in a:
            if k not in out.A:
                out.A[k], out.B[k], out.scale[k] = a[k], b[k], s[k]
    return out


def save_adapter_state(state: AdapterState, out: str | Path) -> Path:
    """Write ``adapter_model.safetensors`` + ``adapter_config.json`` into ``out`` (atomically)."""
    tensors = {}
    for m in state.modules():
        tensors[f"{m}.lora_A"] = state.A[m].contiguous()
        tensors[f"{m}.lora_B"] = state.B[m].contiguous()
    with atomic_dir(out) as tmp:
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": FORMAT})
        meta = {"format": FORMAT, "config": asdict(state.config) if state.config else None,
                "scale": state.scale}
        (tmp / "adapter_config.json").write_text(json.dumps(meta, indent=2))
    return Path(out)


def save_adapter(model, name: str, out: str | Path, config: Optional[LoRAConfig] = None) -> None:
    """Gather adapter ``name`` (every rank calls this) and write it on rank 0."""
    if not any(name in lora.A for _, _, lora in lora_layers(model)):
        raise ValueError(f"no LoRA adapter called {name!r} on the model")
    state = gather_adapter(model, name)
    if state is not None:
        state.config = config
        save_adapter_state(state, out)
    if dist.is_initialized():
        dist.barrier()


def adapter_files(path: str | Path, kind: str) -> tuple[Path, Path, dict]:
    """(adapter_config.json, adapter_model.safetensors, parsed config) of an adapter folder of
    ``kind`` (for the error message); errors name the missing or unreadable file."""
    path = Path(path)
    cfg_path, st_path = path / "adapter_config.json", path / "adapter_model.safetensors"
    for p in (cfg_path, st_path):
        if not p.is_file():
            raise FileNotFoundError(f"{p}: missing; {path} is not {kind} folder")
    try:
        return cfg_path, st_path, json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path}: not valid JSON ({e})") from None


def load_adapter_tensors(st_path: Path) -> dict[str, torch.Tensor]:
    """``adapter_model.safetensors`` (verified against the enclosing manifest); a truncated or
    corrupt file is an error naming it."""
    verify_under(st_path)
    try:
        return load_file(str(st_path))
    except Exception as e:  # safetensors raises its own SafetensorError for a cut-off file
        raise ValueError(f"{st_path}: unreadable safetensors file ({str(e)[:200]})") from None


def read_adapter_state(path: str | Path) -> AdapterState:
    """An adapter folder written by ``save_adapter_state``; errors name the file."""
    cfg_path, st_path, meta = adapter_files(path, "a glm5-mcore adapter")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{cfg_path}: format {meta.get('format')!r}, expected {FORMAT!r} "
                         "(an HF PEFT adapter? use glm5_mcore.lora.peft.import_peft)")
    tensors = load_adapter_tensors(st_path)
    state = AdapterState(config=LoRAConfig(**meta["config"]) if meta.get("config") else None)
    for m, s in meta["scale"].items():
        for k in (f"{m}.lora_A", f"{m}.lora_B"):
            if k not in tensors:
                raise ValueError(f"{st_path}: tensor {k} missing")
        state.A[m], state.B[m], state.scale[m] = tensors[f"{m}.lora_A"], tensors[f"{m}.lora_B"], float(s)
    return state


def load_adapter_state(model, state: AdapterState, name: str, trainable: bool = True,
                       dropout: float = 0.0) -> int:
    """Install ``state`` as adapter ``name`` on this rank's modules (any layout). Every module of
    the state must exist in the model (experts and layers of other EP/PP ranks are skipped).
    Returns #modules installed here."""
    *_, layer_offset, expert_offset = rank_offsets(model)
    n, seen = 0, set()
    for local_name, mod in linear_targets(model):
        fam = family_of(local_name)
        if fam is None or not isinstance(getattr(mod, "weight", None), torch.Tensor):
            continue
        gname = global_module_name(local_name, layer_offset, expert_offset)
        if gname not in state.A:
            continue
        lora = attach_any(mod, gname, fam)
        lora.install(name, state.A[gname], state.B[gname], state.scale[gname], dropout, mod.weight.dtype,
                     mod.weight.device)
        for p in (lora.A[name], lora.B[name]):
            p.requires_grad_(trainable)
        seen.add(gname)
        n += 1
    whole = ps.get_expert_model_parallel_world_size() == 1 and ps.get_pipeline_model_parallel_world_size() == 1
    unseen = sorted(set(state.A) - seen)
    if whole and unseen:
        raise ValueError(f"adapter {name!r}: {len(unseen)} module(s) not in this model, e.g. {unseen[:3]}")
    return n


def load_into(model, state: AdapterState, name: str, where: str | Path, optional_prefixes: tuple = ()) -> None:
    """Load ``state``'s full tensors into the adapter ``name`` already attached to this rank's modules
    (a resume: same targets, any layout). A module the state lacks is an error naming ``where`` unless
    its name starts with one of ``optional_prefixes`` (an RL run's MTP block, measured but not trained)."""
    for _, _, lora in lora_layers(model):
        if name not in lora.A:
            continue
        if lora.module_name not in state.A:
            if optional_prefixes and lora.module_name.startswith(optional_prefixes):
                continue
            raise ValueError(f"{where}: no adapter for {lora.module_name} (saved with other lora.targets?)")
        try:
            lora.load_full_(name, state.A[lora.module_name], state.B[lora.module_name])
        except RuntimeError as e:  # another rank: a size mismatch
            raise ValueError(f"{where}: adapter {lora.module_name} does not fit this run "
                             f"({' '.join(str(e).split())[:160]})") from None

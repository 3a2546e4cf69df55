"""LoRA on grouped routed experts (Megatron-Core's ``TEGroupedMLP``: one grouped linear per layer, ``weight{i}``
per local expert; on the CPU over ``cpu_compat.GroupedLinear``), one adapter per expert as on ``SequentialMLP``.

Each local expert ``i`` of a grouped ``linear_fc1`` / ``linear_fc2`` gets a ``LoRALayer`` named as the
``SequentialMLP`` path names it (``...mlp.experts.local_experts.{i}.linear_fc1``, global expert index), so the
``AdapterState`` names, the saved adapters and the PEFT export are the same under both layouts and a run resumes
across them. The layers live in ``GroupedLoRA`` (the grouped linear's ``lora`` child, ``experts.{i}``) and one
forward hook adds, over the dispatched tokens ``x [T, in]`` split by ``m_splits``, each expert's
``scale · B_i(A_i(dropout(x_i)))``: with ``torch.nn.functional.grouped_mm`` on CUDA when every expert runs the same
rank and ``grouped_mm`` takes the shapes (bf16, rank / in / out % 8: ``grouped_fits``; no Python loop over
experts), else per expert (the CPU: its ``grouped_mm`` has no working backward, as
``cpu_compat.GroupedLinear`` says). The groups' offsets go to the device without a host sync (pinned,
non-blocking: ``grouped_offsets``), once for fc1 and fc2 of a layer, which get the same ``m_splits``.

``ExpertSlot`` stands for one expert of a grouped linear where the model-level code expects a base linear
(``.weight`` is ``weight{i}``; merge adds into it). Under expert tensor parallelism (``etp > 1``) it is column-
(fc1) or row-parallel (fc2) over the expert-TP group as ``weight{i}``'s ``partition_dim`` says, and its
``LoRALayer`` splits the factors as ``SequentialMLP``'s experts do (``lora.layers``: the replicated factor's
gradient all-reduced over the expert-TP group); the stacked CUDA path does the same on the stacked factors.
"""

from __future__ import annotations

import functools
import re
from typing import Iterator

import torch
import torch.nn.functional as F

from megatron.core import parallel_state as ps

from glm5_mcore.device import to_device_async
from glm5_mcore.lora.layers import LoRALayer, attach, dropout_rng, expert_tp_factors

GROUPED_MM_DEVICES = {"cuda"}
"""Device types whose ``grouped_mm`` has a backward (the stacked path runs there; tests add their stand-in)."""


class ExpertSlot:
    """Expert ``index`` of grouped linear ``grouped`` as a base linear: ``weight`` [out, in] is ``weight{index}``."""

    explicit_expert_comm = True  # the dispatcher does the expert-TP communication (as for SequentialMLP's)

    def __init__(self, grouped: torch.nn.Module, index: int):
        self.grouped, self.index, self.config = grouped, index, grouped.config
        # TE clears the grouped linear's own parallel_mode under explicit expert comm; the weight keeps it
        self.parallel_mode = "row" if getattr(self.weight, "partition_dim", 0) == 1 else "column"

    @property
    def tp_group(self):
        """The expert-TP group the grouped linear's weights are split over."""
        return ps.get_expert_tensor_parallel_group()

    @property
    def weight(self) -> torch.nn.Parameter:
        return getattr(self.grouped, f"weight{self.index}")

    @property
    def lora(self):
        lora = getattr(self.grouped, "lora", None)
        return lora.experts[str(self.index)] if isinstance(lora, GroupedLoRA) and str(self.index) in \
            lora.experts else None


class GroupedLoRA(torch.nn.Module):
    """The per-expert ``LoRALayer`` s of one grouped linear (``experts[str(i)]``, local expert ``i``)."""

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleDict()

    def delta(self, x: torch.Tensor, m_splits: list[int]) -> torch.Tensor | None:
        """The adapters' output [T, out] for ``x [T, in]`` in expert order, or None if no expert applies one."""
        layers = [self.experts[str(i)] if str(i) in self.experts else None for i in range(len(m_splits))]
        names = [lora.applied() if lora is not None else None for lora in layers]
        if all(n is None for n in names):
            return None
        alike = None not in names and len({(lo.A[n].shape, lo.scale[n], lo.dropout[n])
                                           for lo, n in zip(layers, names)}) == 1
        a0, b0 = (layers[0].A[names[0]], layers[0].B[names[0]]) if alike else (None, None)
        if alike and x.device.type in GROUPED_MM_DEVICES and grouped_fits(x, a0, b0):
            return _stacked_delta(x, m_splits, layers, names)
        out_f = next(lo for lo in layers if lo is not None).out_features
        outs = [lora.delta(xi, name) if name is not None else xi.new_zeros(xi.shape[0], out_f)
                for xi, lora, name in zip(torch.split(x, m_splits), layers, names)]
        return torch.cat(outs)


def _stacked_delta(x, m_splits, layers, names) -> torch.Tensor:
    lo0, n0 = layers[0], names[0]
    a = torch.stack([lo.A(n) for lo, n in zip(layers, names)])
    b = torch.stack([lo.B(n) for lo, n in zip(layers, names)])
    if lo0.par.expert:  # one gradient all-reduce of the replicated factor for all local experts
        a, b = expert_tp_factors(a, b, lo0.par)
    if lo0.training and lo0.dropout[n0] > 0:
        with dropout_rng(lo0.par):
            x = F.dropout(x, lo0.dropout[n0])
    return grouped_delta(x.to(a.dtype), m_splits, a, b, lo0.scale[n0])


def grouped_fits(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``grouped_mm`` takes these factors (one expert's ``a [r, in]``, ``b [out, r]``, or stacked ``[E, ...]``):
    bf16, every row stride of its operands a multiple of 16 bytes, forward and backward (rank, in, out % 8; the
    backward's upstream gradient is ``[T, out]``)."""
    dims = (a.shape[-2], a.shape[-1], b.shape[-2])
    return x.dtype == a.dtype == b.dtype == torch.bfloat16 and all(d % 8 == 0 for d in dims)


_OFFSETS: list = [None, None]
"""The last (key, offsets) ``grouped_offsets`` made: fc2 reuses fc1's (the same ``m_splits``), a recompute its own."""


def grouped_offsets(m_splits: list[int], device: torch.device) -> torch.Tensor:
    """int32 [E] cumulative group ends of ``m_splits`` on ``device``, as ``grouped_mm``'s ``offs`` takes them, copied
    without a host sync (``device.to_device_async``: pinned, non-blocking; a pageable copy waits for the stream) and
    shared by consecutive calls with the same splits (fc1 and fc2 of one MoE layer)."""
    key = (tuple(m_splits), str(device))
    if _OFFSETS[0] != key:
        ends = torch.tensor(m_splits, dtype=torch.int64).cumsum(0).to(torch.int32)
        _OFFSETS[:] = [key, to_device_async(ends, device)]
    return _OFFSETS[1]


def grouped_delta(x: torch.Tensor, m_splits: list[int], a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """``scale · B_e(A_e x_e)`` for the rows ``x [T, in]`` of each expert ``e`` (``m_splits``), ``a [E, r, in]``,
    ``b [E, out, r]``: two ``grouped_mm`` s, no loop over experts."""
    offs = grouped_offsets(m_splits, x.device)
    h = F.grouped_mm(x, a.transpose(1, 2), offs=offs)
    return F.grouped_mm(h, b.transpose(1, 2), offs=offs) * scale


def _hook(module: torch.nn.Module, args, kwargs, output):
    x = args[0] if args else kwargs["inp"]
    splits = args[1] if len(args) > 1 else kwargs["m_splits"]
    d = module.lora.delta(x, [int(s) for s in splits])
    if d is None:
        return output
    if isinstance(output, tuple):
        return (output[0] + d.to(output[0].dtype), *output[1:])
    return output + d.to(output.dtype)


def is_grouped(module: torch.nn.Module) -> bool:
    """A grouped expert linear (TE's or ``cpu_compat.GroupedLinear``): ``num_gemms`` weights ``weight{i}``."""
    return hasattr(module, "num_gemms") and hasattr(module, "weight0")


def linear_targets(model: torch.nn.Module) -> Iterator[tuple[str, object]]:
    """(module path, module) of every module of ``model``, a grouped expert linear replaced by its experts as
    ``ExpertSlot`` s under ``SequentialMLP``'s paths (``.experts.local_experts.{i}.linear_fc1``)."""
    for name, mod in list(model.named_modules()):
        if not is_grouped(mod):
            yield name, mod
            continue
        for i in range(mod.num_gemms):
            yield re.sub(r"\.experts\.(linear_fc[12])$", rf".experts.local_experts.{i}.\1", name), ExpertSlot(mod, i)


def _with_adapters(grouped: torch.nn.Module, base_sd, prefix: str = "", sharded_offsets: tuple = (),
                   metadata=None) -> dict:
    """The grouped linear's ``sharded_state_dict`` plus its adapters as ``SequentialMLP`` shards them: expert ``i``'s
    ``{prefix}lora.experts.{i}.A.{adapter}`` under the key ``{prefix}lora.A.{adapter}`` at global expert
    ``ep_rank · n + i`` on a new leading axis, one replica per expert-DP group (``TEGroupedMLP`` then renames
    ``linear_fc1.`` to ``experts.linear_fc1.``, as for the weights). The base linear's own method does not
    recurse into children (TE's and ``cpu_compat.GroupedLinear``'s alike), so the optimizer would miss them."""
    from megatron.core.dist_checkpointing.utils import replace_prefix_for_sharding
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    out = base_sd(prefix, sharded_offsets, metadata)
    n = grouped.num_gemms
    first, n_global = ps.get_expert_model_parallel_rank() * n, ps.get_expert_model_parallel_world_size() * n
    edp = ps.get_expert_data_parallel_group()
    for key, lora in grouped.lora.experts.items():
        i = int(key)
        params = {f"{i}.lora.{f}.{a}": p for f, fac in (("A", lora.A), ("B", lora.B)) for a, p in fac.items()}
        sub = make_sharded_tensors_for_checkpoint(params, "", {}, (*sharded_offsets, (len(sharded_offsets),
                                                  first + i, n_global)), tp_group=ps.get_expert_tensor_parallel_group(),
                                                  dp_cp_group=(metadata or {}).get("dp_cp_group") or edp)
        replace_prefix_for_sharding(sub, f"{i}.", prefix)
        for name, sh in sub.items():
            sh.replica_id = (*sh.replica_id[:2], edp.rank())
            f, a = name.split(".")[-2:]
            out[f"{prefix}lora.experts.{i}.{f}.{a}"] = sh
    return out


def attach_any(module, name: str, family: str) -> LoRALayer:
    """``layers.attach`` for a linear, or the ``LoRALayer`` of one expert of a grouped linear (``ExpertSlot``)."""
    if not isinstance(module, ExpertSlot):
        return attach(module, name, family)
    g = module.grouped
    if not isinstance(getattr(g, "lora", None), GroupedLoRA):
        g.lora = GroupedLoRA()
        g.register_forward_hook(_hook, with_kwargs=True)
        g.sharded_state_dict = functools.partial(_with_adapters, g, g.sharded_state_dict)
    key = str(module.index)
    if key not in g.lora.experts:
        g.lora.experts[key] = LoRALayer(module, name, family)
    return g.lora.experts[key]


def expert_layers(name: str, mod: torch.nn.Module) -> Iterator[tuple[str, ExpertSlot, LoRALayer]]:
    """(path, slot, layer) of each adapted expert of grouped linear ``mod`` at ``name``."""
    for key, lora in mod.lora.experts.items():
        yield f"{name}.lora.experts.{key}", ExpertSlot(mod, int(key)), lora

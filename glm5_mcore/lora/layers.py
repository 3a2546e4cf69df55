"""The LoRA layer on one Megatron-Core linear, tensor-parallel correct (the model-level API: ``lora.apply``).

``apply_lora(model, cfg, name)`` attaches a ``LoRALayer`` to each chosen linear (as its ``lora``
submodule) and a forward hook: the base module's own forward always runs unchanged, and the
low-rank delta ``scale · B(A(dropout(x)))`` is added to its output afterwards. Several named adapters
can live on one model; one is active per forward (``set_adapter``), ``disable_adapters`` turns them
all off (the RL reference policy), ``merge``/``unmerge`` fold the active one into the base weight.

Tensor parallelism follows the base module (shapes per rank, r = rank):

    column-parallel  W [out/tp, in]:  A [r, in] replicated,  B [out/tp, r] sharded on dim 0
        h = x·Aᵀ, then all-gathered over the sequence (sequence parallel) or copied into the TP
        region (its grad all-reduced) before B — the same communication the base layer does,
        on r channels instead of ``in``.
    row-parallel     W [out, in/tp]:  A [r, in/tp] sharded on dim 1,  B [out, r] replicated
        h = x·Aᵀ is a partial sum, reduce-scattered (SP) or all-reduced before B.
    duplicated / local experts: plain LoRA (no communication).

Routed experts under expert TP (``etp > 1``; ``explicit_expert_comm``: the token dispatcher all-gathers the
tokens over the expert-TP group before the experts and reduce-scatters fc2's partial sums after them) are
split as Megatron splits their weights, over ``parallel_state.get_expert_tensor_parallel_group()``: fc1 B
[out/etp, r] (the gated halves each split, as the weight), fc2 A [r, in/etp], the other factor replicated.
No activation is communicated (each rank's delta is its share of the base output's, reduced with it by the
dispatcher); the replicated factor's gradient, a partial sum per rank, is all-reduced over the expert-TP
group in the backward (``copy_to_tensor_model_parallel_region`` on the factor itself).

Adapter parameters carry the partition attributes Megatron's grad finalisation and checkpoint
helpers read (``tensor_model_parallel``, ``partition_dim``, ``sequence_parallel``, ``allreduce``).
Initialisation is done on the full (unsharded) tensors from a generator seeded by the module name,
then sliced, so every TP/EP/ETP layout gets the same adapter (Megatron's expert RNG tracker is seeded per EP
and ETP rank, so its draws could not be one rank's; the module name already makes each expert's its own).
Dropout masks: ``dropout_rng``.

Families (Megatron names): MLA ``linear_q_down_proj``, ``linear_q_up_proj``, ``linear_kv_down_proj``,
``linear_kv_up_proj``, ``linear_proj``; dense MLP and shared expert ``linear_fc1``, ``linear_fc2``;
routed experts ``experts.linear_fc1``, ``experts.linear_fc2`` (one adapter per expert, sharded with
it); DSA indexer ``linear_wq_b``, ``linear_wk``, ``linear_weights_proj``.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from glm5_mcore.checkpoint.hf_names import tp_slice


# --------------------------------------------------------------------------------------------------
# How a base linear is parallelised
# --------------------------------------------------------------------------------------------------
@dataclass
class Parallel:
    """How a base linear is parallelised (``parallel_of``)."""

    mode: str  # "column" | "row" | "none"
    tp_size: int
    tp_rank: int
    group: Optional[object]
    sequence_parallel: bool
    gather_output: bool
    expert: bool = False
    """A routed expert's linear under expert TP: no activation communication, the replicated factor's
    gradient all-reduced over ``group`` (the expert-TP group)."""


def parallel_of(base: torch.nn.Module) -> Parallel:
    """How ``base`` is split over TP: column, row or not at all (and its group, sequence parallelism)."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.utils import get_pg_rank, get_pg_size

    mode = "none"
    if isinstance(base, ColumnParallelLinear) or getattr(base, "parallel_mode", None) == "column":
        mode = "column"
    elif isinstance(base, RowParallelLinear) or getattr(base, "parallel_mode", None) == "row":
        mode = "row"
    group = getattr(base, "tp_group", None)
    size = get_pg_size(group) if group is not None else 1
    if mode == "none" or size == 1:
        return Parallel("none", 1, 0, None, False, False)
    if getattr(base, "explicit_expert_comm", False):  # a routed expert under expert TP
        return Parallel(mode, size, get_pg_rank(group), group, False, False, expert=True)
    if mode == "row" and not getattr(base, "input_is_parallel", True):
        raise ValueError(f"{type(base).__name__}: LoRA needs input_is_parallel=True on row-parallel layers")
    return Parallel(mode, size, get_pg_rank(group), group, bool(getattr(base, "sequence_parallel", False)),
                     bool(getattr(base, "gather_output", False)))


def full_features(base: torch.nn.Module, par: Parallel) -> tuple[int, int]:
    """(in_features, out_features) of the unsharded weight."""
    out_f, in_f = base.weight.shape
    if par.mode == "column":
        out_f *= par.tp_size
    elif par.mode == "row":
        in_f *= par.tp_size
    return in_f, out_f


# --------------------------------------------------------------------------------------------------
# The adapter layer
# --------------------------------------------------------------------------------------------------
class Factors(torch.nn.Module):
    """One factor (A or B) of every adapter on a linear, by adapter name (a mapping, as a ParameterDict), read
    in the forward by calling the module: ``factors(name)``. Megatron DDP with ``overlap_param_gather`` waits
    for a parameter's all-gather only in the forward pre-hook of a module called in the forward whose
    ``parameters(recurse=False)`` hold it; a ParameterDict is never called (torch refuses), so its adapters
    were read with other DP ranks' stale shards (issue 39 G3). The state-dict names stay ``lora.A.{adapter}``
    / ``lora.B.{adapter}``."""

    def forward(self, name: str) -> torch.nn.Parameter:
        return self._parameters[name]

    def __getitem__(self, name: str) -> torch.nn.Parameter:
        return self._parameters[name]

    def __setitem__(self, name: str, value: torch.nn.Parameter) -> None:
        self.register_parameter(name, value)

    def __contains__(self, name) -> bool:
        return name in self._parameters

    def __iter__(self):
        return iter(list(self._parameters))

    def __len__(self) -> int:
        return len(self._parameters)

    def keys(self):
        return self._parameters.keys()

    def items(self):
        return self._parameters.items()


class LoRALayer(torch.nn.Module):
    """The adapters of one base linear: ``A[name]`` [r, in(/tp)], ``B[name]`` [out(/tp), r]."""

    def __init__(self, base: torch.nn.Module, module_name: str, family: str):
        super().__init__()
        self.module_name, self.family = module_name, family
        self.par = parallel_of(base)
        # Megatron's gated fc1 is cat[gate; up] and each TP shard is cat[gate_shard; up_shard]
        self.glu = family.endswith("linear_fc1") and bool(getattr(base.config, "gated_linear_unit", False))
        self.in_features, self.out_features = full_features(base, self.par)
        self.A = Factors()
        self.B = Factors()
        self.scale: dict[str, float] = {}
        self.dropout: dict[str, float] = {}
        self.active: Optional[str] = None
        self.disabled = False
        self.merged: set[str] = set()
        self._base_attrs = {k: getattr(base.weight, k) for k in ("allreduce", "sequence_parallel")
                            if hasattr(base.weight, k)}

    def add(self, name: str, rank: int, alpha: float, dropout: float, init: str, seed: int,
            dtype: torch.dtype, device) -> None:
        if rank > min(self.in_features, self.out_features):
            raise ValueError(f"{self.module_name}: LoRA rank {rank} does not fit a "
                             f"{self.out_features}x{self.in_features} weight")
        g = torch.Generator().manual_seed(
            int.from_bytes(hashlib.sha256(f"{seed}:{name}:{self.module_name}".encode()).digest()[:8], "little"))
        a = torch.empty(rank, self.in_features)
        if init in ("kaiming", "random"):
            bound = 1.0 / math.sqrt(self.in_features)  # kaiming_uniform_(a=sqrt(5)), as nn.Linear / peft
            a.uniform_(-bound, bound, generator=g)
        else:
            a.normal_(0.0, 1.0 / rank, generator=g)
        b = torch.zeros(self.out_features, rank)
        if init == "random":
            b.normal_(0.0, 1.0 / math.sqrt(rank), generator=g)
        self.install(name, a, b, alpha / rank, dropout, dtype, device)

    def install(self, name: str, a_full: torch.Tensor, b_full: torch.Tensor, scale: float, dropout: float,
                dtype: torch.dtype, device) -> None:
        """Add adapter ``name`` from full (unsharded) ``A [r, in]`` and ``B [out, r]``; this rank keeps
        its shard."""
        if name in self.A:
            raise ValueError(f"{self.module_name}: adapter {name!r} already exists")
        r = a_full.shape[0]
        if a_full.shape != (r, self.in_features) or b_full.shape != (self.out_features, r):
            raise ValueError(f"{self.module_name}: adapter {name!r} has A {list(a_full.shape)} and B "
                             f"{list(b_full.shape)}, expected [r, {self.in_features}] and [{self.out_features}, r]")
        a, b = self._shard(a_full, 1, "row"), self._shard(b_full, 0, "column")
        self.A[name] = torch.nn.Parameter(a.to(device=device, dtype=dtype))
        self.B[name] = torch.nn.Parameter(b.to(device=device, dtype=dtype))
        self._tag(self.A[name], self.B[name])
        self.scale[name] = float(scale)
        self.dropout[name] = dropout
        if self.active is None:
            self.active = name

    def full(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) of adapter ``name`` gathered over TP (collective over the base's TP group)."""
        return self.gather(self.A[name].detach(), self.B[name].detach())

    def gather(self, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Full ``(A [r, in], B [out, r])`` from this rank's shards ``a``, ``b`` of an adapter (or of its gradients),
        gathered over the base's TP group (a collective; the gated fc1's B re-interleaved)."""
        p = self.par
        if p.mode == "none":
            return a.clone(), b.clone()
        sharded, dim = (a, 1) if p.mode == "row" else (b, 0)
        parts = [torch.empty_like(sharded) for _ in range(p.tp_size)]
        torch.distributed.all_gather(parts, sharded.contiguous(), group=p.group)
        if self.glu and dim == 0:
            full = torch.cat([x.chunk(2)[0] for x in parts] + [x.chunk(2)[1] for x in parts])
        else:
            full = torch.cat(parts, dim)
        return (full, b.clone()) if p.mode == "row" else (a.clone(), full)

    def _shard(self, full: torch.Tensor, dim: int, mode: str) -> torch.Tensor:
        if self.par.mode != mode:
            return full
        return tp_slice(full, dim, self.par.tp_rank, self.par.tp_size, self.glu and dim == 0).contiguous()

    @torch.no_grad()
    def load_full_(self, name: str, a_full: torch.Tensor, b_full: torch.Tensor) -> None:
        """Overwrite adapter ``name`` in place (same Parameters, so optimizer state stays attached)
        from full tensors; this rank keeps its shard."""
        self.A[name].copy_(self._shard(a_full, 1, "row"))
        self.B[name].copy_(self._shard(b_full, 0, "column"))

    def applied(self) -> Optional[str]:
        """The adapter a forward applies on top of the base weight: the active one, unless adapters
        are disabled or it is already merged into the weight."""
        name = self.active
        return None if self.disabled or name is None or name in self.merged else name

    def _tag(self, a: torch.nn.Parameter, b: torch.nn.Parameter) -> None:
        for p in (a, b):
            for k, v in self._base_attrs.items():
                setattr(p, k, v)
            setattr(p, "tensor_model_parallel", False)
            setattr(p, "partition_dim", -1)
            setattr(p, "partition_stride", 1)
        sharded = a if self.par.mode == "row" else b if self.par.mode == "column" else None
        if sharded is not None:
            setattr(sharded, "tensor_model_parallel", True)
            setattr(sharded, "partition_dim", 1 if sharded is a else 0)
        replicated = b if self.par.mode == "row" else a if self.par.mode == "column" else None
        if replicated is not None:  # its grad is a partial sum over the sequence shards under SP
            setattr(replicated, "sequence_parallel", self.par.sequence_parallel)

    def delta(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """``scale · B(A(dropout(x)))`` in the layout of the base module's output."""
        from megatron.core.tensor_parallel import mappings as m

        a, b = self.A(name), self.B(name)  # called, so DDP's pre-hooks wait for their param gather
        p = self.par
        if self.training and self.dropout[name] > 0:
            with dropout_rng(p):
                x = F.dropout(x, self.dropout[name])
        if p.expert:
            a, b = expert_tp_factors(a, b, p)
        h = F.linear(x.to(a.dtype), a)
        if p.mode == "column" and not p.expert:
            h = (m.gather_from_sequence_parallel_region(h, group=p.group) if p.sequence_parallel
                 else m.copy_to_tensor_model_parallel_region(h, group=p.group))
        elif p.mode == "row" and not p.expert:
            h = (m.reduce_scatter_to_sequence_parallel_region(h, group=p.group) if p.sequence_parallel
                 else m.reduce_from_tensor_model_parallel_region(h, group=p.group))
        out = F.linear(h, b) * self.scale[name]
        if p.mode == "column" and p.gather_output:
            out = m.gather_from_tensor_model_parallel_region(out, group=p.group)
        return out

    def local_delta_weight(self, name: str) -> torch.Tensor:
        """``scale · B·A`` for this rank's shard of the base weight."""
        return (self.B[name] @ self.A[name]) * self.scale[name]


def dropout_rng(par: Parallel):
    """Where the adapter's dropout mask is drawn: fc2's input under expert TP is sharded [T, in/etp], so from
    Megatron's expert-parallel RNG state (seeded per EP / ETP rank, as Megatron draws dropout on TP-sharded
    activations from the model-parallel one; the CPU's inference tracker forks nothing). Every other input from
    the default generator (the same seed on every rank): fc1's under expert TP is the same tokens on every
    rank of the group and needs the same mask there; the dense row-parallel linears' shards draw one pattern."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, get_expert_parallel_rng_tracker_name

    if par.expert and par.mode == "row":
        return get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name())
    return contextlib.nullcontext()


def expert_tp_factors(a: torch.Tensor, b: torch.Tensor, par: Parallel) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) of an expert linear under expert TP (``par.expert``), the replicated one (fc1's A, fc2's B) passed
    through ``copy_to_tensor_model_parallel_region`` over the expert-TP group: the identity forward, its
    gradient (each rank's partial sum: its shard of fc1's output, its share of fc2's input) all-reduced in the
    backward. Also for the experts' stacked factors [E, r, in] / [E, out, r] (``lora.grouped``)."""
    from megatron.core.tensor_parallel import mappings as m

    if par.mode == "column":
        return m.copy_to_tensor_model_parallel_region(a, group=par.group), b
    return a, m.copy_to_tensor_model_parallel_region(b, group=par.group)


def _lora_input(base: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The input the base weight multiplies: Transformer Engine's LayerNorm-fused linears normalise
    inside, so the adapter applies the same norm."""
    w = getattr(base, "layer_norm_weight", None)
    if w is None:
        return x
    eps = getattr(base, "eps", 1e-5)
    if getattr(base, "normalization", "LayerNorm") == "RMSNorm":
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    else:
        y = F.layer_norm(x.float(), (x.shape[-1],), eps=eps)
    y = y * (1 + w.float() if getattr(base, "zero_centered_gamma", False) else w.float())
    bias = getattr(base, "layer_norm_bias", None)
    return (y + bias.float() if bias is not None else y).to(x.dtype)


def _hook(module: torch.nn.Module, args, kwargs, output):
    lora: LoRALayer = module.lora
    name = lora.applied()
    if name is None:
        return output
    x = args[0] if args else kwargs["input_"]
    d = lora.delta(_lora_input(module, x), name)
    if isinstance(output, tuple):
        return (output[0] + d.to(output[0].dtype), *output[1:])
    return output + d.to(output.dtype)


def attach(module: torch.nn.Module, name: str, family: str) -> LoRALayer:
    """The ``LoRALayer`` of the linear ``module`` (global module path ``name``, LoRA ``family``): created with
    its forward hook on first use, else the one already there. ``apply_lora`` adds new adapters to it and
    ``lora.state.load_adapter_state`` installs saved ones."""
    if not isinstance(getattr(module, "lora", None), LoRALayer):
        module.lora = LoRALayer(module, name, family)
        module.register_forward_hook(_hook, with_kwargs=True)
    return module.lora

"""Host memory (RAM) per node, in each phase of a job, against a node's RAM (``Cluster.host_mem_gib``).

Per GPU of a node (one trainer rank, and in colocated RL one engine shard besides), what lives in host memory:

- every process (a trainer rank; an engine worker): ``HOST_PROCESS``, its CUDA context, Python, PyTorch and
  Megatron-Core or vLLM before it holds any data (an estimate, not a measurement);
- colocated RL with ``rollout.colocate.offload_weights``: the trainer's frozen base in ``HostCopy``'s arena
  (``glm5_mcore.device``), pinned, made at the first offload and kept through both phases;
- colocated RL, generation phase: the optimizer state (fp32 main parameters and Adam moments) Megatron-Core's
  ``offload_to_cpu`` moves to pageable host memory, freed when the trainer restores it;
- colocated RL, training phase, the engine asleep at level 1: vLLM's pinned copy of its weights (level 2 discards
  them; they come back through the push); freed when it wakes;
- Transformer Engine's host copies of an FP8 base's initial values: none, the base is built without them
  (``glm5_mcore.model.fp8_te``; Megatron-Core would otherwise keep 2 bytes a parameter per rank);
- vLLM's LoRA mode, every engine worker: the pushed adapter while it loads and vLLM's CPU cache of adapter
  versions (``lora_host_bytes``).

Separate engines get nodes of their own (their processes only). ``host_reserve_gib`` of each node is held back for
the OS, the page cache of checkpoint reads and Ray's object store.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from glm5_mcore.plan.cluster import GIB, Cluster

HOST_PROCESS = 4 * GIB
"""Host memory of one GPU process before it holds data (CUDA context and driver, Python, PyTorch, Megatron-Core or
vLLM): an estimate."""
PHASES = ("training", "generation")


@dataclass
class HostPlan:
    """Bytes per node, per phase: ``rows`` {what: {phase: bytes}}; ``pinned`` the page-locked part."""
    rows: dict = field(default_factory=dict)
    pinned: dict = field(default_factory=dict)
    capacity: int = 0
    phases: tuple = PHASES
    """RL's training and generation phases; SFT's training only."""
    engine_node: int = 0
    """Separate engines: a node of engine workers (0 when the engines share the trainer's GPUs or there are none)."""

    def add(self, what: str, per_gpu: dict, gpus: int, pinned: bool = False) -> None:
        self.rows[what] = {ph: per_gpu.get(ph, 0) * gpus for ph in self.phases}
        if pinned:
            for ph in self.phases:
                self.pinned[ph] = self.pinned.get(ph, 0) + self.rows[what][ph]

    def total(self, phase: str) -> int:
        return sum(r[phase] for r in self.rows.values())

    @property
    def per_node(self) -> int:
        return max(max(self.total(ph) for ph in self.phases), self.engine_node)

    @property
    def fits(self) -> bool:
        return self.per_node <= self.capacity

    def as_dict(self) -> dict:
        g = lambda x: round(x / GIB, 2)  # noqa: E731
        out = {f"{ph}_phase_gib": g(self.total(ph)) for ph in self.phases}
        out.update({f"pinned_{ph}_gib": g(self.pinned.get(ph, 0)) for ph in self.phases})
        out.update(rows={k: {ph: g(v[ph]) for ph in self.phases} for k, v in self.rows.items()},
                   engine_node_gib=g(self.engine_node), capacity_gib=g(self.capacity), fits=self.fits)
        return out


def plan_host(job, phases, cluster: Cluster, engine_gpus: int = 0, lora_host: int = 0) -> HostPlan:
    """Host bytes per node of ``job`` on ``cluster``: ``phases`` the fullest GPU's
    colocated ``colocate.PhasePlan`` (None: not colocated), ``engine_gpus`` the GPUs of separate engines,
    ``lora_host`` what vLLM's LoRA mode holds in one engine worker's host memory (``lora_host_bytes``)."""
    g = min(cluster.gpus_per_node, job.layout.world)
    h = HostPlan(capacity=cluster.host_usable_bytes, phases=PHASES if job.rollout is not None else PHASES[:1])
    both = dict.fromkeys(PHASES, HOST_PROCESS)
    h.add("trainer processes", both, g)
    if phases is not None:
        h.add("engine workers", both, g)
        if phases.offload_weights:
            frozen = phases.trainer_weights - phases.trainer_resident  # what the trainer offloads of its weights
            h.add("frozen base, offloaded (HostCopy arena)", dict.fromkeys(PHASES, frozen), g, pinned=True)
        h.add("optimizer state, offloaded", {"generation": phases.optimizer}, g)
        if phases.sleep_level == 1:
            h.add("engine weights, asleep (level 1)", {"training": phases.engine_weights}, g, pinned=True)
        if lora_host:
            h.add("engine LoRA adapters (push + vLLM's CPU cache)", {"generation": lora_host}, g)
    elif engine_gpus:
        h.engine_node = (HOST_PROCESS + lora_host) * min(cluster.gpus_per_node, engine_gpus)
    return h


def lora_host_bytes(push_bytes: int, buffers: int, max_loras: int) -> int:
    """One engine worker's host memory in vLLM's LoRA mode: the pushed adapter while vLLM builds its ``LoRAModel``
    from it (every worker gets all of it: ``rl.rollout.vllm_adapters``) and vLLM's CPU cache of ``max_loras + 1``
    versions (``max_cpu_loras``), each what the worker serves (its experts; at most its share of ``buffers``)."""
    return push_bytes + (max_loras + 1) * buffers // max(1, max_loras)


def host_problem(h: HostPlan, cluster: Cluster) -> Optional[str]:
    """The plan's one line when a node's RAM does not hold the job, else None."""
    if h.fits:
        return None
    worst = max(h.phases, key=h.total)
    what = (f"the {worst} phase needs {h.total(worst) / GIB:.0f} GiB per node"
            if h.total(worst) >= h.engine_node else f"an engine node needs {h.engine_node / GIB:.0f} GiB")
    return (f"host memory: {what}, a node has {h.capacity / GIB:.0f} GiB usable ({cluster.host_mem_gib:g} GiB less "
            f"{cluster.host_reserve_gib:g} reserved; --host-mem-gib sets a node's RAM)")


def format_host(h: HostPlan, cluster: Cluster, te_fp8: bool) -> list[str]:
    """The host-memory table: GiB per node, per phase (``te_fp8``: say what TE keeps of an FP8 base)."""
    w = 18
    out = [f"host memory per node ({cluster.gpus_per_node} GPUs, {cluster.host_mem_gib:g} GiB RAM, "
           f"{cluster.host_usable_bytes / GIB:.0f} usable)",
           "GiB per node".ljust(42) + "".join(f"{ph + ' phase':>{w}}" for ph in h.phases),
           "-" * (42 + len(h.phases) * w)]

    def row(label, vals):
        out.append(label.ljust(42) + "".join(f"{v / GIB:>{w}.2f}" for v in vals))

    for what, v in h.rows.items():
        row(what, [v[ph] for ph in h.phases])
    row("TOTAL", [h.total(ph) for ph in h.phases])
    row("  of it pinned (page-locked)", [h.pinned.get(ph, 0) for ph in h.phases])
    if h.engine_node:
        out.append(f"an engine node: {h.engine_node / GIB:.2f} GiB (its workers' processes)")
    if te_fp8:
        out.append("Transformer Engine keeps no host copy of the FP8 base (built without grad: model.fp8_te)")
    out.append(f"per node: {h.per_node / GIB:.2f} GiB of {h.capacity / GIB:.2f} "
               f"({'fits' if h.fits else 'DOES NOT FIT'})")
    return out

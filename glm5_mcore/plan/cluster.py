"""The cluster a job is planned for: nodes × GPUs per node × GPU memory and a node's RAM, with presets.

``usable_bytes`` is what a training or serving process can count on: the card's memory less a
reserve for the CUDA context, NCCL buffers and the caching allocator's slack (measured on H100s:
3-6 GB; we hold back ``reserve_gib``). ``host_usable_bytes`` is a node's RAM less ``host_reserve_gib``
(``plan.host``)."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30


@dataclass(frozen=True)
class Cluster:
    gpu: str
    """Card name, e.g. ``H100-80GB``."""
    gpu_mem_gib: float
    """Memory per card as the vendor states it (80 GB H100 = 79.6 GiB usable by CUDA; we take 80)."""
    nodes: int = 1
    gpus_per_node: int = 8
    reserve_gib: float = 6.0
    """Held back per card: CUDA context, NCCL buffers, allocator fragmentation."""
    host_mem_gib: float = 2048.0
    """A node's RAM (DGX H100 / H200 and the clouds' 8-GPU H100 / H200 nodes: about 2 TiB)."""
    host_reserve_gib: float = 64.0
    """Held back per node: the OS, the page cache of checkpoint reads, Ray's object store."""

    @property
    def num_gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable_bytes(self) -> int:
        return int((self.gpu_mem_gib - self.reserve_gib) * GIB)

    @property
    def host_usable_bytes(self) -> int:
        return int((self.host_mem_gib - self.host_reserve_gib) * GIB)

    def describe(self) -> str:
        return (f"{self.nodes} x {self.gpus_per_node} {self.gpu} ({self.num_gpus} GPUs, {self.host_mem_gib:g} GiB RAM "
                "a node)")


PRESETS = {
    "h100": ("H100-80GB", 80.0, 2048.0),
    "h200": ("H200-141GB", 141.0, 2048.0),
}
"""Preset -> (card, GiB per card, GiB of RAM per 8-GPU node)."""


def cluster_from(spec: str | None, nodes: int | None = None, gpus_per_node: int | None = None,
                 gpu_mem_gib: float | None = None, host_mem_gib: float | None = None) -> Cluster:
    """A cluster from a preset (``h100``, ``h200``, ``h100:16`` = 16 nodes) and/or explicit sizes."""
    name, mem, host, n = "H100-80GB", 80.0, Cluster.host_mem_gib, 1
    if spec:
        key, _, count = spec.partition(":")
        if key.lower() not in PRESETS:
            raise ValueError(f"cluster: unknown preset {key!r}; known: {sorted(PRESETS)} "
                             "(or give --gpu-mem-gib)")
        name, mem, host = PRESETS[key.lower()]
        if count:
            if not count.isdigit() or int(count) < 1:
                raise ValueError(f"cluster: {spec!r}: the node count after ':' must be a positive integer")
            n = int(count)
    if gpu_mem_gib is not None:
        if gpu_mem_gib <= 0:
            raise ValueError(f"cluster.gpu_mem_gib: must be > 0, got {gpu_mem_gib}")
        name, mem = (name if spec else f"GPU-{gpu_mem_gib:g}GB"), float(gpu_mem_gib)
    if host_mem_gib is not None:
        if host_mem_gib <= Cluster.host_reserve_gib:
            raise ValueError(f"cluster.host_mem_gib: must exceed the {Cluster.host_reserve_gib:g} GiB held back per "
                             f"node, got {host_mem_gib}")
        host = float(host_mem_gib)
    nodes = n if nodes is None else nodes
    g = 8 if gpus_per_node is None else gpus_per_node
    if nodes < 1 or g < 1:
        raise ValueError("cluster: nodes and gpus_per_node must be >= 1")
    return Cluster(gpu=name, gpu_mem_gib=mem, nodes=nodes, gpus_per_node=g, host_mem_gib=host)

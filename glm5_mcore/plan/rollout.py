"""Sizing one rollout engine (vLLM, DeepSeek-V3.2-class serving of GLM-5) per GPU.

An engine of ``tp × pp × dp`` GPUs (vLLM's ``tensor_parallel_size``, ``pipeline_parallel_size``,
``data_parallel_size``; ``enable_expert_parallel`` spreads the routed experts over all of them,
otherwise each DP replica holds them sharded over TP) holds, per GPU:

- weights: the decoder (no MTP layer) in bf16, or FP8 block-quantized linears (1 byte per element plus
  one fp32 scale per 128×128 block; embeddings, output layer, norms, router stay bf16/fp32); in LoRA mode vLLM's
  LoRA buffers besides (``lora_buffers``: ``max_loras`` slots at ``max_lora_rank`` for every served linear, every
  local routed expert included);
- the KV cache: MLA's latent ``kv_lora_rank + qk_rope_head_dim`` per token per layer (replicated over
  TP ranks, split over PP stages) plus the DSA indexer's key cache (``index_head_dim`` bytes in FP8 and
  one fp32 scale per token per layer that has an indexer).

What is left of ``gpu_memory_utilization`` × the card after weights and a fixed activation reserve
holds the cache; it says how many sequences of ``prompt + response`` tokens fit at once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from glm5_mcore.config import GLM5Config
from glm5_mcore.plan.cluster import GIB, Cluster
from glm5_mcore.plan.layout import Layout
from glm5_mcore.plan.params import stage_tensors

ACTIVATION_RESERVE = 4 * GIB
"""vLLM's profiled activation peak and CUDA graphs at a few thousand batched tokens."""
FP8_BLOCK = 128 * 128


@dataclass(frozen=True)
class EngineSpec:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    expert_parallel: bool = False
    fp8: bool = False
    kv_fp8: bool = False
    gpu_memory_utilization: float = 0.9
    lora_families: tuple = ()
    """LoRA mode: the families vLLM serves as LoRA layers (``lora.targets`` ∩ ``VLLM_LORA``); () merged / none."""
    max_lora_rank: int = 0
    max_loras: int = 1

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @staticmethod
    def from_engine_kwargs(kw: dict) -> "EngineSpec":
        """From ``rollout.engine_kwargs`` as they are passed to ``vllm.LLM``."""
        return EngineSpec(tp=int(kw.get("tensor_parallel_size", 1)), pp=int(kw.get("pipeline_parallel_size", 1)),
                          dp=int(kw.get("data_parallel_size", 1)),
                          expert_parallel=bool(kw.get("enable_expert_parallel", False)),
                          fp8=kw.get("quantization") == "fp8", kv_fp8=str(kw.get("kv_cache_dtype", "")).startswith("fp8"),
                          gpu_memory_utilization=float(kw.get("gpu_memory_utilization", 0.8)))


@dataclass
class EnginePlan:
    spec: EngineSpec
    weights: int
    kv_per_token: int
    """KV-cache bytes per token on one GPU."""
    kv_budget: int
    sequences: int
    """Sequences of prompt + response tokens that fit at once (over the engine's DP replicas)."""
    needed: int
    fits: bool
    why: str

    def as_dict(self) -> dict:
        return {"gpus": self.spec.gpus, "tp": self.spec.tp, "pp": self.spec.pp, "dp": self.spec.dp,
                "expert_parallel": self.spec.expert_parallel, "weights": "fp8" if self.spec.fp8 else "bf16",
                "weights_gib": round(self.weights / GIB, 2), "kv_kib_per_token": round(self.kv_per_token / 1024, 2),
                "kv_budget_gib": round(self.kv_budget / GIB, 2), "sequences_at_once": self.sequences,
                "group_size": self.needed, "fits": self.fits}


def lora_buffers(m: GLM5Config, e: EngineSpec) -> int:
    """Bytes of vLLM's LoRA buffers on the fullest GPU (LoRA mode; 0 otherwise): for every served linear, ``max_loras``
    slots of A ``[max_lora_rank, in]`` and B ``[out, max_lora_rank]`` in bf16, each split as the base weight is
    (``lora/layers``: column-parallel B by rows, row-parallel A by columns); for the routed experts every local
    expert's w1, w3 (each its own A) and w2 (``lora/layers/fused_moe.py:162-222``): 3·r·(H + I) per expert."""
    if not e.lora_families:
        return 0
    r, total = e.max_lora_rank, 0
    expert_shards = e.tp * e.dp if e.expert_parallel else e.tp
    for g in stage_tensors(m, Layout(world=e.tp, tp=e.tp), 0, mtp=False):
        if g.lora_mode is None or g.name not in e.lora_families:
            continue
        o, i = g.shape
        n = r * (o + i) + (r * i if g.name == "experts.linear_fc1" else 0)  # w1 and w3 each have an A
        total += n * (g.count // expert_shards if g.expert else g.count)
    return -(-2 * e.max_loras * total // e.pp)


def engine_weights(m: GLM5Config, e: EngineSpec) -> int:
    """Weight bytes on the fullest GPU of the engine (LoRA mode: with vLLM's LoRA buffers, ``lora_buffers``)."""
    groups = stage_tensors(m, Layout(world=e.tp, tp=e.tp), 0, mtp=False)
    expert_shards = e.tp * e.dp if e.expert_parallel else e.tp
    total = 0
    for g in groups:
        if g.buffer:
            continue
        n = g.total // expert_shards if g.expert else g.total  # TP shards of the rest are in the shapes
        if g.fp32:
            total += 4 * n
        elif e.fp8 and g.lora_mode is not None:
            total += n + 4 * -(-n // FP8_BLOCK)
        else:
            total += 2 * n
    return -(-total // e.pp) + lora_buffers(m, e)


def kv_bytes_per_token(m: GLM5Config, e: EngineSpec) -> int:
    layers = m.num_hidden_layers
    indexed = sum(t == "full" for t in m.indexer_types)
    mla = layers * (m.kv_lora_rank + m.qk_rope_head_dim) * (1 if e.kv_fp8 else 2)
    idx = indexed * (m.index_head_dim + 4)
    return -(-(mla + idx) // e.pp)


def plan_engine(m: GLM5Config, e: EngineSpec, cluster: Cluster, n: int, prompt: int, response: int) -> EnginePlan:
    w = engine_weights(m, e)
    per_tok = kv_bytes_per_token(m, e)
    budget = int(cluster.gpu_mem_gib * GIB * e.gpu_memory_utilization) - w - ACTIVATION_RESERVE
    seq = max(0, budget) // (per_tok * (prompt + response)) * e.dp
    if budget <= 0:
        why = "weights do not fit"
    elif seq < n:
        why = f"KV cache holds {seq} sequences, a group needs {n}"
    else:
        why = ""
    return EnginePlan(e, w, per_tok, max(budget, 0), seq, n, not why, why)


def smallest_engine(m: GLM5Config, cluster: Cluster, n: int, prompt: int, response: int,
                    base: EngineSpec) -> EnginePlan | None:
    """The engine with the fewest GPUs (TP within a node, FP8 before more GPUs, then PP) that holds
    the model and a group of ``n`` sequences; None if none up to 8 nodes does."""
    for pp in (1, 2, 4, 8):
        for fp8 in (False, True):
            for tp in (1, 2, 4, 8, 16):
                if tp > cluster.gpus_per_node:
                    continue
                e = replace(base, tp=tp, pp=pp, dp=1, expert_parallel=True, fp8=fp8 or base.fp8)
                p = plan_engine(m, e, cluster, n, prompt, response)
                if p.fits:
                    return p
    return None

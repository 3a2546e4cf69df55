"""One rank of a real layout, built on the CPU: torch.distributed's fake backend, the meta device.

``build_rank`` forms Megatron's process groups for ``layout`` as rank ``rank`` of ``layout.world``
with the ``fake`` backend (collectives are no-ops, nothing is allocated) and builds the project's own
``build_model`` under ``torch.device("meta")``: the exact parameters and buffers that rank would
hold on a GPU, in a few seconds and no memory. ``grad_buffers`` then builds Megatron-Core's
``DistributedDataParallel`` over it (its gradient buffers on the meta device), which is what the
planner's gradient and optimizer bytes are checked against. For tests and ``glm5 plan --verify``.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist

from glm5_mcore.config import GLM5Config
from glm5_mcore.mcore_settings import ParallelConfig
from glm5_mcore.plan.layout import Layout
from glm5_mcore import cpu_compat
from glm5_mcore.lora.apply import apply_lora
from glm5_mcore.lora.config import LoRAConfig
from glm5_mcore.model.build import build_model
from glm5_mcore.model.fp8_linear import stored_bytes
from glm5_mcore.model.indexer_stages import set_indexer_frozen
from glm5_mcore.model.parallel import forget_layout, seed_parallel


def _import_megatron() -> None:
    # Imported before the meta context: a module imported inside it would create its module-level
    # tensors (e.g. MTPLossAutoScaler.main_loss_backward_scale) on the meta device.
    import megatron.core.distributed  # noqa: F401
    import megatron.core.models.gpt.gpt_model  # noqa: F401
    import megatron.core.transformer.experimental_attention_variant.dsa  # noqa: F401
    import megatron.core.transformer.moe.moe_utils  # noqa: F401
    import megatron.core.transformer.multi_token_prediction  # noqa: F401

    import glm5_mcore.model.layer_spec  # noqa: F401
    import glm5_mcore.lora.apply  # noqa: F401


def init_fake(layout: Layout, rank: int) -> None:
    """Megatron's groups for ``layout`` as global ``rank``, over the fake backend (replaces any
    process group this process had)."""
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    cpu_compat.apply()
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
    forget_layout()  # init_parallel must not reuse these groups
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=layout.world)
    ps.initialize_model_parallel(tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
                                 context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep,
                                 expert_tensor_parallel_size=layout.etp, create_gloo_process_groups=False)
    seed_parallel(1234)


def build_rank(model: GLM5Config, layout: Layout, rank: int, *, mtp: bool = True, bf16: bool = True,
               lora: Optional[tuple[tuple, int]] = None, freeze_indexer: bool = True, moe_grouped_gemm: bool = False):
    """The ``GPTModel`` of global ``rank`` in ``layout`` on the meta device. ``mtp=False`` builds it
    without MTP layers (as the RL trainer does); ``lora=(targets, rank)`` applies adapters as the
    recipes do (base frozen); otherwise the indexer is frozen as in full fine-tuning. ``moe_grouped_gemm``:
    the routed experts as ``TEGroupedMLP`` (the TE spec's default), whose tensors and buffers the planner's
    expert rows count as ``SequentialMLP``'s. A frozen FP8 base (``model.base_dtype=fp8``): ``fp8_linear.apply_fp8_base``
    on the built rank swaps its base for ``BlockFP8Weight`` s (``tensor_bytes`` counts their stored bytes)."""
    _import_megatron()
    init_fake(layout, rank)
    dtype = torch.bfloat16 if bf16 else torch.float32
    kw = dict(params_dtype=dtype, bf16=bf16, use_cpu_initialization=True, perform_initialization=False,
              expert_tensor_parallel_size=layout.etp, moe_grouped_gemm=moe_grouped_gemm)
    if not mtp:
        kw["mtp_num_layers"] = None
    with torch.device("meta"):
        m = build_model(model, ParallelConfig(tp=layout.tp, ep=layout.ep, cp=layout.cp, pp=layout.pp,
                                              moe_token_dispatcher_type="allgather",
                                              make_vocab_size_divisible_by=layout.make_vocab_size_divisible_by),
                        device="meta", **kw)
        if lora is not None:
            targets, r = lora
            apply_lora(m, LoRAConfig(rank=r, targets=tuple(targets)), "default", freeze_indexer=freeze_indexer)
        else:
            set_indexer_frozen(m, freeze_indexer)
    return m


@contextlib.contextmanager
def _buffers_on_meta():
    """Megatron's DDP allocates its buffers on ``torch.cuda.current_device()``; here: meta."""
    old = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("meta")  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = old  # type: ignore[assignment]


def grad_buffers(model, distributed_optimizer: bool) -> list[dict]:
    """Megatron-Core DDP's gradient buffers for ``model``: one dict per buffer with ``numel``
    (padded), ``numel_unpadded``, ``grad_bytes`` (element size), ``dp`` (the group it is reduced and,
    with the distributed optimizer, sharded over) and ``expert``."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    with _buffers_on_meta():
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            use_distributed_optimizer=distributed_optimizer), model)
    out = []
    for expert, bufs in ((False, ddp.buffers), (True, ddp.expert_parallel_buffers)):
        for b in bufs:
            out.append({"numel": b.numel, "numel_unpadded": b.numel_unpadded, "expert": expert,
                        "grad_bytes": torch.empty((), dtype=b.grad_dtype).element_size(),
                        "param_dtype": str(b.param_dtype), "dp": b.data_parallel_world_size})
    return out


def tensor_bytes(model) -> dict[str, int]:
    """Parameter and buffer bytes of a built rank: all, routed experts, trainable, buffers."""
    out = {"params": 0, "param_bytes": 0, "expert_params": 0, "trainable": 0, "buffer_bytes": 0}
    for n, p in model.named_parameters():
        out["params"] += p.numel()
        out["param_bytes"] += stored_bytes(p)  # an FP8 base weight: its e4m3 bytes + block scales
        out["expert_params"] += p.numel() if ".experts." in n and ".lora." not in n else 0
        out["trainable"] += p.numel() if p.requires_grad else 0
    for _, b in model.named_buffers():
        out["buffer_bytes"] += b.numel() * b.element_size()
    return out

"""The trainer's accelerator memory handed to a colocated rollout engine while it generates, and back.

Colocated RL (``rl.schedule.colocate``) runs the engine on the trainer's GPUs between the trainer's passes. What
the trainer does not touch during generation goes to host memory (pinned under CUDA) and comes back:

- gradient buffers: Megatron-Core's ``DistributedDataParallel.offload_grad_buffers`` /
  ``restore_grad_buffers`` (the storage is freed and re-zeroed on restore; the views stay valid);
- optimizer state (fp32 main parameters, Adam moments): Megatron-Core's
  ``MegatronOptimizer.offload_to_cpu`` / ``restore_from_cpu`` (CUDA only: ``cpu_compat.optimizer_offload``);
- the frozen base weights, when the planner says the generation phase needs their memory
  (``rollout.offload_weights``): ``glm5_mcore.device.HostCopy``, the same storage trick as Megatron's
  ``_ParamAndGradBuffer.offload_to_cpu`` (param_and_grad_buffer.py:1619) for parameters outside DDP's
  buffers (frozen ones have no buffer there). What each parameter stores is looked up at every offload, after
  a TE FP8 weight's column-wise copy is dropped (``model.fp8_te.drop_columnwise``: TE makes it again in the next
  backward): the row-wise bytes and scales move, and nothing the parameter no longer holds.

Activations need nothing: none live between passes. On CPU every step still runs (the grad buffers and
weights are really freed and restored, so a wrong restore shows in the losses), only nothing is pinned.
"""

from __future__ import annotations

import time

import torch

from glm5_mcore.cpu_compat import optimizer_offload
from glm5_mcore.device import HostCopy, device_memory
from glm5_mcore.model.fp8_linear import stored_tensors
from glm5_mcore.model.fp8_te import drop_columnwise


class TrainerOffload:
    """``offload()`` before the colocated engine wakes, ``restore()`` after it sleeps; each returns figures
    ({"bytes", "seconds", "what": [...], device memory after})."""

    def __init__(self, ddp, optimizer, model: torch.nn.Module, weights: bool):
        self.ddp, self.opt = ddp, optimizer
        self.frozen = [p for p in model.parameters() if not p.requires_grad]
        # an FP8 base: its bytes + scales, as the parameters hold them at each offload
        self.weights = HostCopy(lambda: [t for p in self.frozen for t in stored_tensors(p)]) if weights else None
        self.active = False

    def _grad_bytes(self) -> int:
        return sum(b.grad_data.numel() * b.grad_data.element_size()
                   for b in self.ddp.buffers + self.ddp.expert_parallel_buffers if b.grad_data is not None)

    def offload(self) -> dict:
        if self.active:
            raise RuntimeError("TrainerOffload.offload: already offloaded (restore first)")
        t0 = time.perf_counter()
        grads = self._grad_bytes()
        self.ddp.offload_grad_buffers(synchronize=torch.cuda.is_available(), empty_cache=False)
        optimizer_offload(self.opt, restore=False)
        moved = 0
        if self.weights is not None:
            for p in self.frozen:
                drop_columnwise(p)
            moved = self.weights.offload()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        self.active = True
        what = ["grad_buffers", "optimizer"] + (["frozen_weights"] if self.weights is not None else [])
        return {"what": what, "grad_bytes_freed": grads, "weight_bytes": moved,
                "seconds": time.perf_counter() - t0, **device_memory()}

    def restore(self) -> dict:
        if not self.active:
            raise RuntimeError("TrainerOffload.restore: nothing offloaded")
        t0 = time.perf_counter()
        moved = self.weights.restore() if self.weights is not None else 0
        optimizer_offload(self.opt, restore=True)
        self.ddp.restore_grad_buffers(synchronize=torch.cuda.is_available())
        self.active = False
        return {"weight_bytes": moved, "seconds": time.perf_counter() - t0, **device_memory()}

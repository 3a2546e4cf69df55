"""Shared by the tests and the torchrun scripts they launch (importable from either)."""

from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.utils._python_dispatch import TorchDispatchMode

from glm5_mcore.config import GLM5Config
from glm5_mcore.mcore_settings import ParallelConfig
from glm5_mcore.model.build import build_model
from glm5_mcore.model.parallel import init_parallel
from glm5_mcore.checkpoint.hf_load import load_hf_weights


def hf_model(hf_dir, parallel=None, **overrides):
    """(GPTModel with the HF folder's weights at ``parallel``, its GLM5Config); parallel state is
    initialised for ``parallel``."""
    parallel = parallel or ParallelConfig()
    glm5 = GLM5Config.from_hf_dir(hf_dir)
    init_parallel(parallel)
    m = build_model(glm5, parallel, **overrides)
    load_hf_weights(m, hf_dir, glm5)
    return m, glm5


def megatron_steps(ddp, opt, ids: torch.Tensor, steps: int, loss_after: bool = False) -> list[float]:
    """``steps`` optimizer steps of next-token loss on ``ids`` [B, S+1] through Megatron-Core's
    schedule; the mean loss of each step (before its update), plus the loss after the last update
    with ``loss_after``."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    B, S = ids.shape[0], ids.shape[1] - 1

    def step(_it, model):
        out = model(ids[:, :-1], torch.arange(S)[None].expand(B, -1), None, labels=ids[:, 1:])
        return out, lambda o: (o.float().mean(), {"lm": o.float().mean().detach()})

    losses = []
    for _ in range(steps):
        ddp.zero_grad_buffer()  # DDP main_grad buffers; opt.zero_grad() alone leaves them accumulating
        opt.zero_grad()
        res = get_forward_backward_func()(forward_step_func=step, data_iterator=iter([0]), model=[ddp],
                                          num_microbatches=1, seq_length=S, micro_batch_size=B)
        losses.append(float(res[0]["lm"]))
        ok, grad_norm, _ = opt.step()
        assert ok and grad_norm > 0
    if loss_after:
        with torch.no_grad():
            losses.append(float(step(0, ddp)[0].float().mean()))
    return losses


def peft_model(hf_dir, adapter_dir):
    """(transformers model + our PEFT adapter folder loaded by peft, unexpected keys, missing LoRA keys)."""
    from peft import PeftModel
    from peft.utils.save_and_load import set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    pm = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    res = set_peft_model_state_dict(pm, load_file(str(Path(adapter_dir) / "adapter_model.safetensors")))
    missing_lora = [k for k in res.missing_keys if "lora_" in k]
    return pm, res.unexpected_keys, missing_lora


def save_on_rank0_and_finish(obj, path) -> None:
    """The end of a torchrun check: rank 0 writes ``obj`` to ``path`` (``torch.save``), every rank waits
    for it and leaves the process group."""
    if dist.get_rank() == 0:
        torch.save(obj, path)
    dist.barrier()
    dist.destroy_process_group()


def fp8_folders(root, block: int = 16, mtp: bool = False, seed: int = 0, mla_576: bool = False,
                scale_by: Optional[float] = None):
    """(an FP8 tiny folder in ``block``-square blocks, the same model dequantized to fp32 as a plain folder):
    the pair a frozen FP8 base (``model.base_dtype=fp8``) and an fp32 base of the same values are built from.
    ``scale_by``: every stored scale that many times the canonical ``amax / 448`` and its bytes divided by it
    (a release whose blocks do not map their maximum to 448: a dequantize-requantize would change its bytes)."""
    from safetensors.torch import save_file

    from glm5_mcore.checkpoint.hf_io import HFCheckpoint
    from glm5_mcore.checkpoint.manifest import write_manifest
    from glm5_mcore.config import glm5_tiny
    from glm5_mcore.tiny import mla576, write_hf_checkpoint, write_tiny

    root = Path(root)
    fp8 = write_tiny(root / "fp8", mtp=mtp, seed=seed, mla_576=mla_576, fp8_block=block)
    ckpt = HFCheckpoint(fp8)
    if scale_by is not None:
        sd = {}
        for k in ckpt.keys():
            if not k.endswith("_scale_inv"):
                q, s = ckpt.get_stored(k)
                sd[k] = q if s is None else (q.float() / scale_by).to(torch.float8_e4m3fn)
                if s is not None:
                    sd[k + "_scale_inv"] = s * scale_by
        save_file(sd, str(fp8 / "model.safetensors"), metadata={"format": "pt"})
        write_manifest(fp8)  # the folder's checksums, of the new bytes
        ckpt = HFCheckpoint(fp8)
    sd = {k: ckpt.get(k).contiguous() for k in ckpt.keys() if not k.endswith("_scale_inv")}
    cfg = mla576(glm5_tiny(mtp=mtp)) if mla_576 else glm5_tiny(mtp=mtp)
    return fp8, write_hf_checkpoint(cfg, sd, root / "dense")


class LargestTensor(TorchDispatchMode):
    """The largest tensor any op produces inside the block (``numel``, elements)."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(o, torch.Tensor):
                self.numel = max(self.numel, o.numel())
        return out

"""Run under torchrun: load the tiny HF checkpoint at the given TP/EP layout and save it with
Megatron-Core's distributed checkpointing into the project's checkpoint layout (DIR/iter_0000003)."""

import sys

import torch

from glm5_mcore.training.checkpointing import save_checkpoint
from glm5_mcore.checkpoint.layout import write_hf_meta
from glm5_mcore.mcore_settings import ParallelConfig

from tests.support.helpers import hf_model


def main(hf_dir: str, tp: int, ep: int, out: str) -> None:
    import torch.distributed as dist
    from pathlib import Path

    torch.set_num_threads(1)
    model, _ = hf_model(hf_dir, ParallelConfig(tp=tp, ep=ep))
    save_checkpoint(out, 3, model, {"iteration": 3})
    if dist.get_rank() == 0:
        write_hf_meta(Path(out) / "hf", hf_dir)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])

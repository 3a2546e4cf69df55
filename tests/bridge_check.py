"""Run under torchrun: load the tiny HF checkpoint at the given TP/EP layout and save it with
Megatron-Core's distributed checkpointing into the project's checkpoint layout (DIR/iter_0000003)."""

import sys

import torch

from glm5_mcore.checkpoint import save_checkpoint, write_hf_meta
from glm5_mcore.config import GLM5Config, ParallelConfig
from glm5_mcore.model import build_model, init_parallel, load_hf_weights


def main(hf_dir: str, tp: int, ep: int, out: str) -> None:
    import torch.distributed as dist
    from pathlib import Path

    torch.set_num_threads(1)
    glm5 = GLM5Config.from_hf_dir(hf_dir)
    parallel = ParallelConfig(tp=tp, ep=ep)
    init_parallel(parallel)
    model = build_model(glm5, parallel)
    load_hf_weights(model, hf_dir, glm5)
    save_checkpoint(out, 3, model, {"iteration": 3})
    if dist.get_rank() == 0:
        write_hf_meta(Path(out) / "hf", hf_dir)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])

"""Run under torchrun: load the tiny checkpoint at the given layout, check this rank's parameter
shard shapes against the full HF tensors, and save the (gathered) logits on rank 0."""

import sys

import torch
import torch.distributed as dist

from glm5_mcore.config import GLM5Config, ParallelConfig
from glm5_mcore.checkpoint.hf_io import HFCheckpoint
from glm5_mcore.checkpoint.hf_load import mcore_to_hf_sources
from glm5_mcore.parity import load_input_ids, megatron_forward


def main(hf_dir: str, tp: int, ep: int, cp: int, out: str) -> None:
    torch.set_num_threads(1)
    glm5 = GLM5Config.from_hf_dir(hf_dir)
    ids = load_input_ids(None, glm5.vocab_size, 2, 32, seed=11)
    logits, _, _ = megatron_forward(hf_dir, glm5, ids, ParallelConfig(tp=tp, ep=ep, cp=cp), torch.float32)
    from glm5_mcore.model.build import build_model

    model = build_model(glm5, ParallelConfig(tp=tp, ep=ep, cp=cp))
    ckpt = HFCheckpoint(hf_dir)
    n_experts = 0
    for name, t, src, rank, size in mcore_to_hf_sources(model, glm5.num_hidden_layers):
        full = [ckpt.get(h).shape for h in src.names]
        rows = sum(s[0] for s in full)
        shape = [rows, *full[0][1:]]
        if getattr(t, "tensor_model_parallel", False) and size > 1:
            shape[t.partition_dim] //= size
        assert list(t.shape) == shape, (name, tuple(t.shape), shape)
        n_experts += ".local_experts." in name
    assert n_experts == 2 * 3 * glm5.n_routed_experts // ep, n_experts  # fc1+fc2, 3 MoE layers
    if tp > 1:
        qb = model.decoder.layers[0].self_attention.linear_q_up_proj.weight
        assert qb.shape[0] == glm5.num_attention_heads * glm5.qk_head_dim // tp
    if dist.get_rank() == 0:
        from safetensors.torch import save_file

        save_file({"logits": logits.contiguous()}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])

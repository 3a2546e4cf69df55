"""Run under ``torchrun --nproc_per_node 2``: one training forward + backward of the tiny model with
the sparse-stage indexer loss on a THD pack of three documents, at DP 2 (each rank = one rank alone),
TP 2 and CP 2 in turn; saves (rank 0) per layout each indexer parameter's gradient (summed over CP
ranks, as DDP does), the Σ KL over rows and layers (summed over CP), #rows and the LM loss sum."""

import sys

import torch
import torch.distributed as dist


def one_layout(hf_dir: str, tp: int, cp: int) -> dict:
    from megatron.core import parallel_state as ps

    from glm5_mcore.mcore_settings import ParallelConfig
    from glm5_mcore.model.dsa import GLM5SparseAttention
    from glm5_mcore.data.sft import Document, _batch, split_for_cp
    from tests.support.helpers import hf_model

    torch.set_num_threads(1)
    model, glm5 = hf_model(hf_dir, ParallelConfig(tp=tp, cp=cp), calculate_per_token_loss=True,
                           dsa_indexer_loss_coeff=0.01)
    model.train()
    g = torch.Generator().manual_seed(5)
    docs = [Document(torch.randint(3, glm5.vocab_size, (n + 1,), generator=g).tolist(), [1] * (n + 1))
            for n in (24, 20, 36)]  # multiples of 2·CP·TP: no CP padding rows
    b = split_for_cp(_batch(docs, tp), cp, ps.get_context_parallel_rank() if cp > 1 else 0, 0, tp)
    ce = model(b.input_ids, b.position_ids, None, labels=b.labels, packed_seq_params=b.packed_seq_params(),
               loss_mask=b.loss_mask)
    lm = (ce * b.loss_mask).sum()
    lm.backward()
    cores = [m for m in model.modules() if isinstance(m, GLM5SparseAttention)]
    stats = torch.tensor([float(sum(c.indexer_stats[0] for c in cores)), sum(c.indexer_stats[1] for c in cores),
                          float(lm.detach())], dtype=torch.float64)
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if ".indexer." in n}
    assert grads and all(v is not None for v in grads.values())
    if cp > 1:
        group = ps.get_context_parallel_group()
        dist.all_reduce(stats, group=group)
        for v in grads.values():
            dist.all_reduce(v, group=group)
    return {"stats": stats, **{f"grad.{k}": v.contiguous() for k, v in grads.items()}}


def main(hf_dir: str, out: str) -> None:
    res = {}
    for tp, cp in ((1, 1), (2, 1), (1, 2)):
        res.update({f"tp{tp}cp{cp}.{k}": v for k, v in one_layout(hf_dir, tp, cp).items()})
    if dist.get_rank() == 0:
        from safetensors.torch import save_file

        save_file(res, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

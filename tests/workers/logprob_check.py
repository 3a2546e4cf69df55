"""Run under torchrun: vocab-parallel log-probs + entropy of the tiny model at TP=2 equal the
single-process full-vocabulary values (rank 0 writes both)."""

import sys

import torch
import torch.distributed as dist

from glm5_mcore.config import GLM5Config, ParallelConfig
from glm5_mcore.model.build import build_model, forward_logits
from glm5_mcore.model.parallel import init_parallel
from glm5_mcore.checkpoint.hf_load import load_hf_weights
from glm5_mcore.model.mtp_loss import model_token_logprobs


def main(hf_dir: str, tp: int, out: str) -> None:
    torch.set_num_threads(1)
    glm5 = GLM5Config.from_hf_dir(hf_dir)
    init_parallel(ParallelConfig(tp=tp))
    m = build_model(glm5, ParallelConfig(tp=tp))
    load_hf_weights(m, hf_dir, glm5)
    m.eval()
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, glm5.vocab_size, (2, 16), generator=g)
    tgt = torch.randint(0, glm5.vocab_size, (2, 16), generator=g)
    pos = torch.arange(16)[None].expand(2, -1)
    with torch.no_grad():
        lp, ent = model_token_logprobs(m, ids, pos, tgt, temperature=0.8)
        full = forward_logits(m, ids).float() / 0.8
    ref_lp = torch.log_softmax(full, -1).gather(-1, tgt[..., None])[..., 0]
    ref_ent = -(torch.softmax(full, -1) * torch.log_softmax(full, -1)).sum(-1)
    if dist.get_rank() == 0:
        torch.save({"lp": lp, "ent": ent, "ref_lp": ref_lp, "ref_ent": ref_ent}, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])

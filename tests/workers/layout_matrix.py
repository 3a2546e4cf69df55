"""Run under ``torchrun --nproc_per_node WORLD``: every "layout X equals one rank" case of one world
size in a single launch, re-laying out the process group between cases (``init_parallel``).

Usage: layout_matrix.py CASES.json OUT.pt, where CASES.json is ``[{"id", "check", "hf_dir", "tp", "ep",
"cp"}]``; rank 0 writes ``{id: result}``. The checks are plain functions the tests also call in-process
at one rank for the reference (``tests/layouts/test_layouts.py``):

- ``logits``: this rank's parameter shards have the shapes the full HF tensors imply; the logits,
  gathered to natural token order ([B, S, V]);
- ``lora_steps``: 3 SGD steps of LoRA on MLA + MLP + experts, every rank the same batch; the per-step
  losses + the loss after, and the adapter gathered into full tensors (saved next to OUT);
- ``logprobs``: vocab-parallel token log-probs and entropy [B, S] next to the full-vocabulary values
  computed from the gathered logits;
- ``sft_losses``: the per-step losses of a 3-step SGD run of the SFT recipe (``recipes.sft.run`` on the
  config ``glm5 sft`` composes from the same overrides) on the reverse task;
- ``fp8_ckpt_logits``: a checkpoint storing its base in FP8 loaded as stored into a frozen FP8 base (each shard's
  bytes checked), and its logits.
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from glm5_mcore.checkpoint.hf_io import HFCheckpoint  # noqa: E402
from glm5_mcore.checkpoint.hf_load import load_hf_weights, mcore_to_hf_sources  # noqa: E402
from glm5_mcore.checkpoint.layout import hf_source_dir  # noqa: E402
from glm5_mcore.config import GLM5Config  # noqa: E402
from glm5_mcore.mcore_settings import ParallelConfig  # noqa: E402
from glm5_mcore.lora.apply import apply_lora  # noqa: E402
from glm5_mcore.lora.config import EXPERTS, MLA, MLP, LoRAConfig  # noqa: E402
from glm5_mcore.lora.state import save_adapter  # noqa: E402
from glm5_mcore.model.build import build_model, forward_logits  # noqa: E402
from glm5_mcore.model.fp8_linear import BlockFP8Weight  # noqa: E402
from glm5_mcore.model.mtp_loss import model_token_logprobs  # noqa: E402
from glm5_mcore.model.parallel import init_parallel  # noqa: E402
from glm5_mcore.parity import load_input_ids, megatron_forward  # noqa: E402
from glm5_mcore.training.model_source import resolve_model  # noqa: E402
from glm5_mcore.training.schema import ModelCfg  # noqa: E402

from recipes.hydra_app import compose  # noqa: E402
from recipes.sft import SFTConfig, run  # noqa: E402
from tests.support.helpers import hf_model, megatron_steps  # noqa: E402
from tests.support.sft_setup import reverse_task  # noqa: E402

SEQ = 32
# SGD maps equal gradients to equal updates; Adam turns fp32 reduction-order noise in near-zero
# gradients into full-size steps, so layouts drift apart for numerical, not semantic, reasons.
OPT, LR = "sgd", 0.1


def logits(hf_dir: str, parallel: ParallelConfig, out: str) -> dict:
    """{"logits": [2, 32, V]} of the tiny model at ``parallel``, after checking this rank's shards."""
    glm5 = GLM5Config.from_hf_dir(hf_dir)
    ids = load_input_ids(None, glm5.vocab_size, 2, 32, seed=11)
    got, _, _ = megatron_forward(hf_dir, glm5, ids, parallel, torch.float32)
    model = build_model(glm5, parallel)
    ckpt = HFCheckpoint(hf_dir)
    n_experts = 0
    for name, t, src, rank, size in mcore_to_hf_sources(model, glm5.num_hidden_layers):
        full = [ckpt.get(h).shape for h in src.names]
        shape = [sum(s[0] for s in full), *full[0][1:]]
        if getattr(t, "tensor_model_parallel", False) and size > 1:
            shape[t.partition_dim] //= size
        assert list(t.shape) == shape, (name, tuple(t.shape), shape)
        n_experts += ".local_experts." in name
    assert n_experts == 2 * 3 * glm5.n_routed_experts // parallel.ep, n_experts  # fc1+fc2, 3 MoE layers
    if parallel.tp > 1:
        qb = model.decoder.layers[0].self_attention.linear_q_up_proj.weight
        assert qb.shape[0] == glm5.num_attention_heads * glm5.qk_head_dim // parallel.tp
    return {"logits": got.contiguous()}


def lora_steps(hf_dir: str, parallel: ParallelConfig, out: str) -> dict:
    """{"losses": 3 steps' losses + the loss after, "adapter": the folder of the gathered adapter}."""
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    m, glm5 = hf_model(hf_dir, parallel)
    apply_lora(m, LoRAConfig(rank=4, alpha=8, targets=MLA + MLP + EXPERTS, init="random"))
    m.train()
    m.config.finalize_model_grads_func = finalize_model_grads  # DP/EP grad sync + SP/TP all-reduces
    m = DistributedDataParallel(m.config, DistributedDataParallelConfig(), m)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer=OPT, lr=LR, clip_grad=1.0), [m])
    in_opt = {id(p) for g in opt.param_groups for p in g["params"]}
    adapters = {id(p) for n, p in m.named_parameters() if ".lora." in n}
    assert in_opt == adapters  # only adapters get optimizer state: no base weight, no (frozen) indexer
    ids = load_input_ids(None, glm5.vocab_size, 2, SEQ + 1, seed=7)
    losses = megatron_steps(m, opt, ids, 3, loss_after=True)
    save_adapter(m.module, "default", out + ".adapter")  # gathered over TP / EP into full tensors
    return {"losses": losses, "adapter": out + ".adapter"}


def logprobs(hf_dir: str, parallel: ParallelConfig, out: str) -> dict:
    """{"lp", "ent"}: vocab-parallel values at ``parallel``; {"ref_lp", "ref_ent"}: from full logits."""
    glm5 = GLM5Config.from_hf_dir(hf_dir)
    init_parallel(parallel)
    m = build_model(glm5, parallel)
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
    return {"lp": lp, "ent": ent, "ref_lp": ref_lp, "ref_ent": ref_ent}


def sft_losses(hf_dir: str, parallel: ParallelConfig, out: str, rows: int = 64, extra: tuple = ()) -> dict:
    """{"losses": [3 steps]} of ``glm5 sft`` at ``parallel`` (SGD: equal gradients give equal updates,
    Adam would amplify fp32 reduction-order noise); ``extra``: more overrides (LoRA targets)."""
    init_parallel(parallel)
    data = f"{out}.train.jsonl"
    if dist.get_rank() == 0:
        reverse_task(data, rows, 0)
    dist.barrier()  # written before any rank reads it
    args = [f"model.hf_dir={hf_dir}", f"data.train={data}", "data.micro_batch_tokens=128",
            "data.global_batch_tokens=256", "data.max_tokens=64", "train.steps=3", "optim.optimizer=sgd",
            "optim.lr=0.1", "optim.decay_style=constant", "wandb.mode=disabled", "train.progress=false",
            *extra, f"parallel.tp={parallel.tp}", f"parallel.ep={parallel.ep}", f"parallel.cp={parallel.cp}",
            f"parallel.pp={parallel.pp}", f"train.out={out}.run"]
    return {"losses": [h["loss"] for h in run(SFTConfig.from_dict(compose("sft", args)))["history"]]}


def fp8_ckpt_logits(ckpt: str, parallel: ParallelConfig, out: str) -> dict:
    """{"logits": [2, 32, V], "fp8": #FP8 weights}: a checkpoint storing its base in FP8 (``hf-to-mcore`` of an FP8
    folder) loaded as stored (``model.ckpt`` + ``model.base_dtype=fp8``) at ``parallel``, after checking every
    FP8 shard holds the bytes and scales ``load_hf_weights`` shards out of the HF origin's stored ones."""
    init_parallel(parallel)
    source = resolve_model(ModelCfg(ckpt=ckpt, base_dtype="fp8"), lora_enabled=True)
    m = build_model(source.glm5, parallel, base_fp8_block=source.base_fp8_block)
    source.load_weights(m)
    ref = build_model(source.glm5, parallel, base_fp8_block=source.base_fp8_block)
    load_hf_weights(ref, hf_source_dir(ckpt), source.glm5)
    got, want = dict(m.named_parameters()), dict(ref.named_parameters())
    n = 0
    for name, w in want.items():
        if isinstance(w, BlockFP8Weight):
            g = got[name]
            assert isinstance(g, BlockFP8Weight) and torch.equal(g.data_fp8.view(torch.uint8), w.data_fp8.view(
                torch.uint8)) and torch.equal(g.scale_inv, w.scale_inv), name
            n += 1
    ids = load_input_ids(None, source.glm5.vocab_size, 2, SEQ, seed=11)
    with torch.no_grad():
        logits = forward_logits(m.eval(), ids)
    return {"logits": logits.contiguous(), "fp8": n}


CHECKS = {"logits": logits, "lora_steps": lora_steps, "logprobs": logprobs, "sft_losses": sft_losses,
          "fp8_ckpt_logits": fp8_ckpt_logits}


def run_case(case: dict, out: str) -> dict:
    """One case of the matrix at its layout (``tp``, ``ep``, ``cp``, ``pp``; 1 where absent), with the
    check's keyword arguments ``kwargs``."""
    parallel = ParallelConfig(**{k: case.get(k, 1) for k in ("tp", "ep", "cp", "pp")})
    return CHECKS[case["check"]](case["hf_dir"], parallel, f"{out}.{case['id']}", **case.get("kwargs", {}))


def main(cases_path: str, out: str) -> None:
    torch.set_num_threads(1)
    results = {case["id"]: run_case(case, out) for case in json.loads(Path(cases_path).read_text())}
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

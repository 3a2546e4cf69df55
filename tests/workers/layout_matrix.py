"""Run under ``torchrun --nproc_per_node WORLD``: every "layout X equals one rank" case of one world
size in a single launch, re-laying out the process group between cases (``init_parallel``).

Usage: layout_matrix.py CASES.json OUT.pt, where CASES.json is ``[{"id", "check", "hf_dir", "tp", "ep",
"cp"}]``; rank 0 writes ``{id: result}``. The checks are plain functions the tests also call in-process
at one rank for the reference (``tests/layouts/test_layouts.py``):

- ``logits``: this rank's parameter shards have the shapes the full HF tensors imply; the logits,
  gathered to natural token order ([B, S, V]);
- ``lora_steps``: 3 SGD steps of LoRA on MLA + MLP + experts, every rank the same batch; the per-step
  losses + the loss after, and the adapter gathered into full tensors (saved next to OUT);
- ``lora_grads``: two SGD steps of LoRA on MLA + MLP + experts (every rank the same batch): the logits before,
  each step's loss, grad norm and every adapter gradient gathered into full tensors, the adapter after;
- ``logprobs``: vocab-parallel token log-probs and entropy [B, S] next to the full-vocabulary values
  computed from the gathered logits;
- ``sft_losses``: the per-step losses of a 3-step SGD run of the SFT recipe (``recipes.sft.run`` on the
  config ``glm5 sft`` composes from the same overrides) on the reverse task, and the run's folder;
- ``rl_logprobs``: the RL trainer (``rl.train.trainer.PolicyTrainer``) on a fixed batch: old / reference
  log-probs, one PPO update's metrics (entropy, losses), the log-probs after it, the PEFT adapter it pushes;
- ``recompute_grads``: one forward+backward of two THD micro-batches through Megatron's schedule (1F1B under
  PP) with LoRA dropout on, without recompute, with selective and with full recompute: each mode's losses and
  its largest adapter-gradient difference from no recompute (max over ranks, relative to the largest gradient);
- ``fp8_ckpt_logits``: a checkpoint storing its base in FP8 loaded as stored into a frozen FP8 base (each shard's
  bytes checked), and its logits.
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from glm5_mcore.checkpoint.hf_io import HFCheckpoint  # noqa: E402
from glm5_mcore.checkpoint.hf_load import load_hf_weights, mcore_to_hf_sources  # noqa: E402
from glm5_mcore.checkpoint.layout import hf_source_dir  # noqa: E402
from glm5_mcore.config import GLM5Config  # noqa: E402
from glm5_mcore.mcore_settings import ParallelConfig, padded_vocab_size  # noqa: E402
from glm5_mcore.lora.apply import apply_lora  # noqa: E402
from glm5_mcore.lora.config import EXPERTS, MLA, MLP, LoRAConfig  # noqa: E402
from glm5_mcore.lora.state import save_adapter  # noqa: E402
from glm5_mcore.model.build import build_model, forward_logits  # noqa: E402
from glm5_mcore.model.fp8_linear import BlockFP8Weight  # noqa: E402
from glm5_mcore.model.mtp_loss import model_token_logprobs  # noqa: E402
from glm5_mcore.model.parallel import init_parallel  # noqa: E402
from glm5_mcore.model.vocab import VOCAB_PARALLEL  # noqa: E402
from glm5_mcore.parity import load_input_ids, megatron_forward, model_source  # noqa: E402
from glm5_mcore.training.model_source import resolve_model  # noqa: E402
from glm5_mcore.training.schema import ModelCfg  # noqa: E402

from recipes.hydra_app import compose  # noqa: E402
from rl.train.batch import RolloutBatch  # noqa: E402
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
    got, _, _ = megatron_forward(model_source(hf_dir), ids, parallel, torch.float32)
    model = build_model(glm5, parallel)
    ckpt = HFCheckpoint(hf_dir)
    n_experts = 0
    for name, t, src, rank, size in mcore_to_hf_sources(model, glm5.num_hidden_layers):
        full = [ckpt.get(h).shape for h in src.names]
        shape = [sum(s[0] for s in full), *full[0][1:]]
        if name in VOCAB_PARALLEL:  # the vocabulary padded for TP (129 at TP 2: 130 rows, 65 per rank)
            shape[0] = padded_vocab_size(shape[0], parallel.tp)
        if getattr(t, "tensor_model_parallel", False) and size > 1:
            shape[t.partition_dim] //= size
        assert list(t.shape) == shape, (name, tuple(t.shape), shape)
        n_experts += ".local_experts." in name and name.startswith("decoder.")  # not the MTP layer's
    assert n_experts == 2 * 3 * glm5.n_routed_experts // parallel.ep, n_experts  # fc1+fc2, 3 MoE layers
    if parallel.tp > 1:
        qb = model.decoder.layers[0].self_attention.linear_q_up_proj.weight
        assert qb.shape[0] == glm5.num_attention_heads * glm5.qk_head_dim // parallel.tp
    return {"logits": got.contiguous()}


def lora_steps(hf_dir: str, parallel: ParallelConfig, out: str, grouped: bool = False) -> dict:
    """{"losses": 3 steps' losses + the loss after, "adapter": the folder of the gathered adapter}; ``grouped``:
    the routed experts as ``TEGroupedMLP`` (``lora.grouped``)."""
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    m, glm5 = hf_model(hf_dir, parallel, moe_grouped_gemm=grouped)
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


def lora_grads(hf_dir: str, parallel: ParallelConfig, out: str, grouped: bool = False) -> dict:
    """{"logits": [2, 32, V] before training, "losses", "norms": 2 steps' loss and grad norm (the optimizer's: each
    replicated factor counted once), "grads": 2 steps' {module: (dA, dB)} full, "adapter": {module: (A, B)} full
    after}; ``grouped``: the routed experts as ``TEGroupedMLP``."""
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from glm5_mcore.lora.apply import lora_layers

    m, glm5 = hf_model(hf_dir, parallel, moe_grouped_gemm=grouped)
    apply_lora(m, LoRAConfig(rank=4, alpha=8, targets=MLA + MLP + EXPERTS, init="random"))
    ids = load_input_ids(None, glm5.vocab_size, 2, SEQ + 1, seed=7)
    with torch.no_grad():
        logits0 = forward_logits(m.eval(), ids[:, :-1]).contiguous()
    m.train()
    m.config.finalize_model_grads_func = finalize_model_grads
    ddp = DistributedDataParallel(m.config, DistributedDataParallelConfig(), m)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer=OPT, lr=LR, clip_grad=1e9), [ddp])  # norm, no clip
    B, S = ids.shape[0], SEQ

    def step(_it, model):
        o = model(ids[:, :-1], torch.arange(S)[None].expand(B, -1), None, labels=ids[:, 1:])
        return o, lambda t: (t.float().mean(), {"lm": t.float().mean().detach()})

    def gathered(get) -> dict:
        local = {lora.module_name: tuple(t.clone() for t in lora.gather(*get(lora))) for _, _, lora in lora_layers(m)}
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local)
        return {k: v for part in parts for k, v in part.items()}

    losses, norms, grads = [], [], []
    for _ in range(2):
        ddp.zero_grad_buffer()
        opt.zero_grad()
        res = get_forward_backward_func()(forward_step_func=step, data_iterator=iter([0]), model=[ddp],
                                          num_microbatches=1, seq_length=S, micro_batch_size=B)
        grads.append(gathered(lambda lo: (lo.A["default"].main_grad, lo.B["default"].main_grad)))
        ok, norm, _ = opt.step()
        assert ok
        losses.append(float(res[0]["lm"]))
        norms.append(float(norm))
    return {"logits": logits0, "losses": losses, "norms": norms, "grads": grads, "tp": parallel.tp,
            "adapter": gathered(lambda lo: (lo.A["default"].detach(), lo.B["default"].detach()))}


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


def sft_losses(hf_dir: str, parallel: ParallelConfig, out: str, rows: int = 64, extra: tuple = (),
               source: str = "model.hf_dir") -> dict:
    """{"losses": [3 steps]} of ``glm5 sft`` at ``parallel`` (SGD: equal gradients give equal updates,
    Adam would amplify fp32 reduction-order noise); ``extra``: more overrides (LoRA targets); ``source``: the
    field ``hf_dir`` is given as (``model.ckpt``: a checkpoint)."""
    init_parallel(parallel)
    data = f"{out}.train.jsonl"
    if dist.get_rank() == 0:
        reverse_task(data, rows, 0)
    dist.barrier()  # written before any rank reads it
    args = [f"{source}={hf_dir}", f"data.train={data}", "data.micro_batch_tokens=128",
            "data.global_batch_tokens=256", "data.max_tokens=64", "train.steps=3", "optim.optimizer=sgd",
            "optim.lr=0.1", "optim.decay_style=constant", "wandb.mode=disabled", "train.progress=false",
            *extra, f"parallel.tp={parallel.tp}", f"parallel.ep={parallel.ep}", f"parallel.cp={parallel.cp}",
            f"parallel.etp={parallel.etp}",
            f"parallel.pp={parallel.pp}", f"train.out={out}.run"]
    return {"losses": [h["loss"] for h in run(SFTConfig.from_dict(compose("sft", args)))["history"]],
            "run": f"{out}.run"}


def rl_batch(vocab: int) -> RolloutBatch:
    """2 prompts x 2 samples of seeded tokens (the vocabulary's last id in every response), GRPO scores."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, vocab, (9,), generator=g).tolist() for _ in range(2)]
    responses = [[*torch.randint(3, vocab, (n - 1,), generator=g).tolist(), vocab - 1] for n in (11, 6, 9, 12)]
    logprobs = [(-torch.rand(len(r), generator=g) * 3).tolist() for r in responses]
    batch = RolloutBatch.build([prompts[i // 2] for i in range(4)], responses, logprobs, [0, 0, 1, 1])
    batch.scores = torch.tensor([1.0, 0.0, 0.0, 1.0])
    return batch


def rl_logprobs(hf_dir: str, parallel: ParallelConfig, out: str) -> dict:
    """{"old", "ref", "after": [4, R] log-probs, "metrics": the update's}: the RL trainer at ``parallel``'s TP
    (every rank one DP replica's share), its policy adapter's B drawn from full tensors (the same at every
    layout), on ``rl_batch``."""
    from glm5_mcore.lora.apply import lora_layers
    from rl.config import RLConfig
    from rl.train import algos
    from rl.train.trainer import PolicyTrainer

    init_parallel(parallel)
    cfg = RLConfig.from_dict({
        "model": {"hf_dir": hf_dir}, "wandb": {"mode": "disabled"}, "rollout": {"n": 2, "temperature": 0.8},
        "actor": {"ppo_mini_batch_size": 1, "micro_batch_tokens": 64, "entropy_coeff": 0.01, "lr": 1e-3},
        "trainer": {"world_size": dist.get_world_size(), "tp": parallel.tp}})
    trainer = PolicyTrainer(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, _, lora in lora_layers(trainer.model):
            a, b = lora.full("default")
            lora.load_full_("default", a, torch.randn(b.shape, generator=g) * 0.05)
    batch = rl_batch(GLM5Config.from_hf_dir(hf_dir).vocab_size)

    def log_probs(ref: bool, keys: tuple) -> dict:
        res = [trainer.compute_log_probs(batch, ref=ref)]
        dist.broadcast_object_list(res, src=0)  # the reporting rank's rows (every rank holds the whole batch)
        for key in keys:  # [n, R] rows in micro-batch order -> batch.{key} [4, R]
            batch.set_rows(key, {i: row[: len(batch.responses[i])] for i, row in zip(res[0]["rows"], res[0][key])})

    log_probs(True, ("old_log_probs", "ref_log_probs"))
    old, ref = batch.old_log_probs, batch.ref_log_probs
    algos.rollout_correction(cfg, batch)
    algos.compute_advantages(cfg, batch, 0.0)
    metrics = trainer.update(batch, 0)
    log_probs(False, ("old_log_probs",))
    payload = trainer.export_adapter(1)  # what the weight sync pushes to the engines (rank 0)
    return {"old": old, "ref": ref, "after": batch.old_log_probs, "mask": batch.response_mask,
            "pushed": load(payload.files["adapter_model.safetensors"]) if payload is not None else None,
            "metrics": {k: v for k, v in (metrics or {}).items() if isinstance(v, float) and not k.startswith("timing")}}


def recompute_grads(hf_dir: str, parallel: ParallelConfig, out: str, dropout: float = 0.1) -> dict:
    """{"losses": {mode: [2 micro-batches' mean CE]}, "grad_diff": {mode: max |g - g_none| / max |g_none|}} for
    mode None / selective / full, each from the same seed (the same adapter, the same dropout draws). The
    dropout on ``linear_kv_up_proj``'s adapter keeps every mode on the unabsorbed DSA core (dsa.py
    ``_absorbable``); the absorbed one under full recompute: the ``sft_losses`` cases with recompute."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from glm5_mcore.mcore_settings import recompute_overrides
    from glm5_mcore.model.build import packed_seq_params_from_lengths

    g = torch.Generator().manual_seed(5)
    vocab = GLM5Config.from_hf_dir(hf_dir).vocab_size
    docs = [[14, 10, 8], [9, 17, 6]]  # 32 tokens each (SP splits it over TP), every doc but one past top-k 8
    micro = [(torch.randint(3, vocab, (1, sum(d) + 1), generator=g), d) for d in docs]
    losses, grads = {}, {}
    for mode in (None, "selective", "full"):
        m, glm5 = hf_model(hf_dir, parallel, **recompute_overrides(mode))  # re-seeds: the same draws each mode
        apply_lora(m, LoRAConfig(rank=4, alpha=8, targets=MLA + MLP + EXPERTS, init="random", dropout=dropout))
        m.train()
        m.config.finalize_model_grads_func = finalize_model_grads
        ddp = DistributedDataParallel(m.config, DistributedDataParallelConfig(), m)

        def step(it, model):
            ids, lengths = next(it)
            T = ids.shape[1] - 1
            pos = torch.cat([torch.arange(n) for n in lengths])[None]
            out = model(ids[:, :-1], pos, None, labels=ids[:, 1:],
                        packed_seq_params=packed_seq_params_from_lengths(lengths))
            return out, lambda o: (o.float().mean(), {"lm": o.float().mean().detach()})

        res = get_forward_backward_func()(forward_step_func=step, data_iterator=iter(micro), model=[ddp],
                                          num_microbatches=len(micro), seq_length=32, micro_batch_size=1)
        lm = torch.tensor([float(r["lm"]) for r in res] or [0.0, 0.0])
        if ps.get_pipeline_model_parallel_world_size() > 1:  # only the last stage has the losses
            dist.all_reduce(lm, group=ps.get_pipeline_model_parallel_group())
        losses[mode] = lm.tolist()
        grads[mode] = {n: p.main_grad.clone() for n, p in ddp.module.named_parameters() if ".lora." in n}
    ref = grads[None]
    top = torch.tensor([max(float(v.abs().max()) for v in ref.values())])
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    diff = {}
    for mode in ("selective", "full"):
        d = torch.tensor([max(float((grads[mode][k] - v).abs().max()) for k, v in ref.items())])
        dist.all_reduce(d, op=dist.ReduceOp.MAX)
        diff[mode] = float(d) / float(top)
    return {"losses": losses, "grad_diff": diff, "grad_max": float(top)}


def fp8_ckpt_logits(ckpt: str, parallel: ParallelConfig, out: str) -> dict:
    """{"logits": [2, 32, V], "fp8": #FP8 weights, "ep"}: a checkpoint storing its base in FP8 (``hf-to-mcore`` of an
    FP8 folder) loaded as stored, or a dense one (``--dequantize-fp8``) quantized into the base, by ``model.ckpt`` +
    ``model.base_dtype=fp8`` at ``parallel``, after checking every FP8 shard holds the bytes and scales
    ``load_hf_weights`` shards out of the HF origin's stored ones."""
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
    return {"logits": logits.contiguous(), "fp8": n, "ep": parallel.ep}


CHECKS = {"logits": logits, "lora_steps": lora_steps, "lora_grads": lora_grads, "logprobs": logprobs, "sft_losses": sft_losses,
          "rl_logprobs": rl_logprobs, "recompute_grads": recompute_grads, "fp8_ckpt_logits": fp8_ckpt_logits}


def run_case(case: dict, out: str) -> dict:
    """One case of the matrix at its layout (``tp``, ``ep``, ``cp``, ``pp``, ``etp``; 1 where absent), with the
    check's keyword arguments ``kwargs``."""
    parallel = ParallelConfig(**{k: case.get(k, 1) for k in ("tp", "ep", "cp", "pp", "etp")})
    return CHECKS[case["check"]](case["hf_dir"], parallel, f"{out}.{case['id']}", **case.get("kwargs", {}))


def main(cases_path: str, out: str) -> None:
    torch.set_num_threads(1)
    results = {}
    for case in json.loads(Path(cases_path).read_text()):
        t = time.perf_counter()
        results[case["id"]] = run_case(case, out)
        if dist.get_rank() == 0:
            print(f"{case['id']}: {time.perf_counter() - t:.1f} s", file=sys.stderr)
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

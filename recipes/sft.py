"""``glm5 sft``: LoRA or full-parameter SFT / continued pretraining of GLM-5 on Megatron-Core.

One process per rank under torchrun (gloo on CPU, NCCL on GPU), or one process alone. Batches are
token budgets: ``global_batch_tokens`` per optimizer step, ``micro_batch_tokens`` per THD-packed
micro-batch, gradient accumulation = global / (micro × DP). The loss is Σ CE over loss tokens
divided by the loss-token count of the whole step summed over DP (Megatron's
``calculate_per_token_loss``), so it does not change with the parallel layout.

``run(cfg)`` takes a plain ``SFTConfig`` (Hydra stops at the entry point, ``recipes.cli``) and reads top to
bottom: the model source (``training.model_source``), the checks, the claimed run folder, the model and
its training stage, the trainer, the resumed state (``training.checkpointing``), the data stream
(``data.stream``), then the steps, each logged (``training.run_log``) and saved as configured.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from transformers import AutoTokenizer

from glm5_mcore.config import GLM5Config
from glm5_mcore.mcore_settings import ParallelConfig, recompute_overrides, token_multiple
from glm5_mcore.data.indexed import check_data, check_tokenizer, is_jsonl, parse_blend, resolve_prefix
from glm5_mcore.data.sft import PackedBatch
from glm5_mcore.data.stream import SFTDocuments, SFTStream, is_indexed
from glm5_mcore.device import training_device
from glm5_mcore.lora.config import INDEXER
from glm5_mcore.lora.apply import apply_lora
from glm5_mcore.model.build import build_model
from glm5_mcore.model.fp8_linear import check_base_dtype
from glm5_mcore.model.indexer_stages import (check_indexer_learns, indexer_metrics, set_indexer_frozen,
                                              set_indexer_warmup, set_recall_probe)
from glm5_mcore.model.mtp_loss import mtp_depth_losses
from glm5_mcore.model.parallel import init_parallel
from glm5_mcore.model.vocab import real_vocab_size
from glm5_mcore.training.checkpointing import restore_run, save_run
from glm5_mcore.training.loop import MoELoad, build_trainer, check_optimizer, forward_backward, synced_params
from glm5_mcore.training.model_source import ModelSource, resolve_model
from glm5_mcore.training.resume import (SaveSchedule, claim_run_dir, file_fingerprint, guard_resume, model_fingerprint,
                                         refuse_restart_over)
from glm5_mcore.training.run_log import RunLogger
from recipes.sft_config import DataCfg, LoRACfg, ModelCfg, SFTConfig, TrainCfg  # noqa: F401  (the schema)

CONSOLE_KEYS = (("loss", "loss"), ("val_loss", "val_loss"), ("mtp_loss", "mtp_loss/depth_1"),
                ("indexer/loss", "indexer/loss"), ("indexer/recall", "indexer/recall"),
                ("moe/max_over_mean", "moe/max_over_mean"), ("lr", "lr"), ("grad_norm", "grad_norm"),
                ("tokens_per_s", "tokens_per_s"))
"""What the progress bar shows of each step's metrics, as ``(short name, metric key)``."""


def data_inputs(d: "DataCfg") -> list[str]:
    """The indexed-dataset prefixes named by ``data.blend`` (none for jsonl runs)."""
    if not d.blend:
        return []
    return parse_blend(d.blend)[0]


def data_fingerprint(path: Optional[str]):
    """A jsonl file's size + digest; an indexed dataset's ``.idx`` digest (every document's length)
    and ``.bin`` size, without reading the corpus."""
    if not path or is_jsonl(path):
        return file_fingerprint(path)
    try:
        prefix = resolve_prefix(path)
    except FileNotFoundError:
        return path
    return {"idx": file_fingerprint(f"{prefix}.idx"), "bin_size": Path(f"{prefix}.bin").stat().st_size}


SCHEDULE_NOTES = {"train.steps": "the length of the optim.decay_style LR schedule; resumed anyway, the schedule "
                                  "is recomputed over the new length from the saved step"}
"""What a changed schedule setting does to a resumed run (``resume.guard_resume``'s notes)."""


def run_settings(cfg: SFTConfig, world: int) -> dict:
    """What a resume must keep (``glm5_mcore.training.resume``): data, batch sizes, LoRA, model, layout, and
    ``train.steps`` where the LR schedule decays over it (any ``optim.decay_style`` but constant): the saved
    scheduler state holds the old length, which Megatron's scheduler keeps on load
    (``use_checkpoint_opt_param_scheduler``), so a longer run would silently continue at ``min_lr`` past it."""
    d, lo = cfg.data, cfg.lora
    data = {"train": data_fingerprint(d.train), "valid": data_fingerprint(d.valid),
            "blend": [data_fingerprint(x) for x in data_inputs(d)], "split": d.split,
            "micro_batch_tokens": d.micro_batch_tokens, "global_batch_tokens": d.global_batch_tokens,
            "max_tokens": d.max_tokens, "seed": d.seed}
    if d.blend:  # the weights decide which documents a step draws, as much as the members do
        data["blend_weights"] = parse_blend(d.blend)[1]
    return {
        "data": data,
        "lora": {"enabled": lo.enabled, "name": lo.name, "rank": lo.rank, "alpha": lo.alpha,
                 "targets": sorted(lo.targets)} if lo.enabled else {"enabled": False},
        "model": model_fingerprint(cfg.model.hf_dir, cfg.model.ckpt),
        "layout": {"world_size": world, **{k: getattr(cfg.parallel, k) for k in ("tp", "ep", "cp", "pp")},
                   **({"etp": cfg.parallel.etp} if cfg.parallel.etp > 1 else {}),
                   **({"make_vocab_size_divisible_by": cfg.parallel.make_vocab_size_divisible_by}
                      if cfg.parallel.make_vocab_size_divisible_by > 1 else {})},
        **({"train": {"steps": cfg.train.steps}} if cfg.optim.decay_style != "constant" else {}),
    }


# --------------------------------------------------------------------------------------------------
# checks that run before any work
# --------------------------------------------------------------------------------------------------
def validate(cfg: SFTConfig, glm5: GLM5Config, world: int) -> tuple[ParallelConfig, int]:
    """The parallel layout and gradient-accumulation count; ValueErrors name the field."""
    parallel = cfg.parallel
    try:
        parallel.validate(glm5)  # heads, MLP widths % tp, experts % ep, ...: from the config, before any build
    except ValueError as e:
        raise ValueError(f"parallel.{e}") from None
    glm5.to_mcore_config(parallel)
    if parallel.pp > 1 and glm5.num_hidden_layers % parallel.pp:
        raise ValueError(f"parallel.pp={parallel.pp} does not divide num_hidden_layers={glm5.num_hidden_layers}")
    if world % (parallel.tp * parallel.cp * parallel.pp):
        raise ValueError(f"parallel.tp*cp*pp={parallel.tp * parallel.cp * parallel.pp} does not divide the "
                         f"world size {world}")
    check_base_dtype(cfg.model.base_dtype, trains_base=not cfg.lora.enabled or cfg.train.indexer_warmup)
    if world % (parallel.etp * parallel.ep * parallel.pp):
        raise ValueError(f"parallel.etp*ep*pp={parallel.etp * parallel.ep * parallel.pp} does not divide the "
                         f"world size {world}")
    dp = world // (parallel.tp * parallel.cp * parallel.pp)
    check_optimizer(cfg.optim, dp, "optim")
    d = cfg.data
    if d.micro_batch_tokens < 2 or d.global_batch_tokens % (d.micro_batch_tokens * dp):
        raise ValueError(f"data.global_batch_tokens={d.global_batch_tokens} must be a multiple of "
                         f"data.micro_batch_tokens × DP = {d.micro_batch_tokens} × {dp}")
    if d.max_tokens > d.micro_batch_tokens:
        raise ValueError(f"data.max_tokens={d.max_tokens} exceeds data.micro_batch_tokens={d.micro_batch_tokens}")
    if not d.train and not d.blend:
        raise ValueError("data.train: no training file given")
    if d.train and d.blend:
        raise ValueError("data.train and data.blend: give one")
    if is_indexed(d):  # indexed: every prefix exists, the blend parses
        check_data(d)
    elif d.split:
        raise ValueError("data.split: splits indexed datasets; for jsonl give data.valid")
    elif d.valid and not is_jsonl(d.valid):
        raise ValueError(f"data.valid={d.valid}: jsonl training data needs jsonl validation data")
    if cfg.train.recompute not in (False, True, "full", "selective"):
        raise ValueError(f"train.recompute={cfg.train.recompute!r}: false, true (full), full or selective")
    if not torch.cuda.is_available():
        for flag, why in (("bf16", "Megatron's Float16Optimizer wraps CUDA tensors"),
                          ("cpu_offload", "optimizer offload moves CUDA states to host")):
            if getattr(cfg.train, flag):
                raise ValueError(f"train.{flag}: needs CUDA ({why}); CPU runs are fp32 without it")
    if cfg.train.steps < 1:
        raise ValueError("train.steps must be >= 1")
    _check_indexer_settings(cfg)
    return parallel, d.global_batch_tokens // (d.micro_batch_tokens * dp)


def _check_indexer_settings(cfg: SFTConfig) -> None:
    """A trainable indexer needs a loss: the LM loss never reaches it (its top-k is not differentiable)."""
    t = cfg.train
    if (t.indexer_warmup or not t.freeze_indexer) and t.indexer_loss_coeff <= 0:
        raise ValueError(f"train.indexer_loss_coeff={t.indexer_loss_coeff}: the indexer trains "
                         f"({'train.indexer_warmup=true' if t.indexer_warmup else 'train.freeze_indexer=false'}) "
                         "but only its KL loss reaches it; set train.indexer_loss_coeff > 0 (e.g. 0.001) or "
                         "train.freeze_indexer=true")
    if cfg.lora.enabled and not t.freeze_indexer and not t.indexer_warmup and not set(cfg.lora.targets) & set(INDEXER):
        raise ValueError("train.freeze_indexer=false with LoRA: the indexer learns through adapters on its "
                         f"linears, and lora.targets has none (add {', '.join(INDEXER)})")


# --------------------------------------------------------------------------------------------------
# the training step
# --------------------------------------------------------------------------------------------------
def _forward_step(batch_iter, model):
    b: PackedBatch = next(batch_iter).to(training_device())
    out = model(b.input_ids, b.position_ids, None, labels=b.labels, packed_seq_params=b.packed_seq_params(),
                loss_mask=b.loss_mask)

    def loss_func(ce):
        total = (ce.float() * b.loss_mask).sum()
        n = b.loss_mask.sum().to(torch.int)
        return total, n, {"lm": torch.stack([total.detach(), n.float()])}

    return out, loss_func


def step_losses(ddp, batches: list[PackedBatch], forward_only: bool) -> tuple[float, float]:
    """Run (forward+backward or forward) over this rank's micro-batches: (Σ CE, #loss tokens) over DP."""
    # Megatron's schedule takes the sequence length before the CP split (schedules.py divides it by CP to
    # size the pipeline's P2P buffers); these batches are this CP rank's share (split_for_cp)
    seq = max(b.num_tokens for b in batches) * ps.get_context_parallel_world_size()
    res = forward_backward(ddp, _forward_step, batches, forward_only, seq)
    tot = torch.zeros(2, device=training_device())
    for r in res:  # only the last pipeline stage computes the loss
        tot += r["lm"].float()
    group = ps.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tot, group=group)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(tot, group=ps.get_pipeline_model_parallel_group())
    return float(tot[0]), float(tot[1])


# --------------------------------------------------------------------------------------------------
# the phases of a run
# --------------------------------------------------------------------------------------------------
def claim(cfg: SFTConfig, settings: dict, rank0: bool, record: Optional[Callable[[], None]]) -> None:
    """``train.out`` claimed (never an input, never another run's folder), a resume's settings checked,
    then ``record`` (rank 0): all before any work."""
    if rank0:
        claim_run_dir(cfg.train.out, "sft", [cfg.model.hf_dir, cfg.model.ckpt, cfg.data.train, cfg.data.valid,
                                             *data_inputs(cfg.data)])
    if cfg.train.resume:  # refuse changed settings before any work
        guard_resume(cfg.train.out, settings, cfg.train.allow_resume_mismatch, "train", SCHEDULE_NOTES)
    else:
        refuse_restart_over(cfg.train.out, "train")
    if record is not None and rank0:
        record()


def build(cfg: SFTConfig, source: ModelSource, parallel: ParallelConfig):
    """The process groups, the model with its base weights, and the training stage: indexer warm-up
    (the indexer alone), LoRA adapters, or full fine-tuning."""
    init_parallel(parallel, seed=cfg.train.seed)
    random.seed(cfg.train.seed)
    t = cfg.train
    overrides = dict(calculate_per_token_loss=True, mtp_loss_scaling_factor=t.mtp_loss_scale,
                     moe_router_bias_update_rate=t.moe_bias_update_rate,
                     dsa_indexer_loss_coeff=0.0 if t.freeze_indexer else t.indexer_loss_coeff)
    if t.moe_aux_loss_coeff > 0:
        overrides.update(moe_aux_loss_coeff=t.moe_aux_loss_coeff, moe_router_load_balancing_type="seq_aux_loss")
    if t.bf16:
        overrides.update(bf16=True, params_dtype=torch.bfloat16)
    overrides.update(recompute_overrides(t.recompute))
    model = build_model(source.glm5, parallel, dsa_kernel_backend=cfg.model.dsa_kernel_backend,
                        moe_grouped_gemm=cfg.model.moe_grouped_gemm, base_fp8_block=source.base_fp8_block,
                        **overrides)
    source.load_weights(model)
    if t.indexer_warmup:
        if cfg.lora.enabled:
            raise ValueError("train.indexer_warmup trains the indexer alone: set lora.enabled=false")
        for p in model.parameters():
            p.requires_grad_(False)
        set_indexer_frozen(model, False)
        set_indexer_warmup(model, t.indexer_loss_coeff)
    elif cfg.lora.enabled:
        apply_lora(model, cfg.lora.to_lora_config(seed=t.seed), cfg.lora.name, freeze_indexer=t.freeze_indexer)
    else:
        set_indexer_frozen(model, t.freeze_indexer)
    check_indexer_learns(model)
    set_recall_probe(model)  # indexer/recall also with a frozen indexer: how far attention drifts from it
    return model


def save(cfg: SFTConfig, source: ModelSource, model, opt, sched, state: dict) -> None:
    """Iteration ``state["step"]``: adapters (LoRA; the base stays where ``model.ckpt`` / ``model.hf_dir`` has
    it) or the whole model, the optimizer, every rank's scheduler and RNG."""
    adapters = {cfg.lora.name: cfg.lora.to_lora_config(seed=cfg.train.seed)} if cfg.lora.enabled else None
    save_run(cfg.train.out, state["step"], model, opt, sched, state, adapters=adapters, save_base=not cfg.lora.enabled,
             hf_dir=source.hf_dir, base_ckpt=cfg.model.ckpt, keep_last=cfg.train.keep_last)


def restore(cfg: SFTConfig, model, opt, sched, settings: dict) -> dict:
    """The state to start from: ``train.out``'s latest iteration if it was saved with the same ``settings``
    (or ``train.allow_resume_mismatch``), weights/adapters in place, optimizer, scheduler, RNG and data
    position; else step 0."""
    it = guard_resume(cfg.train.out, settings, cfg.train.allow_resume_mismatch, "train",
                      SCHEDULE_NOTES) if cfg.train.resume else None
    if it is None:
        return {"step": 0, "epoch": 0, "cursor": 0, "sample": 0, "tokens": 0, "settings": settings}
    # told to resume anyway: this run's schedule (optim.*, train.steps) from the saved step, not the saved one's
    sched.override_opt_param_scheduler = cfg.train.allow_resume_mismatch
    lora = (cfg.lora.name,) if cfg.lora.enabled else ()
    state, _ = restore_run(cfg.train.out, it, model, opt, sched, adapters=lora, load_base=not cfg.lora.enabled)
    state["settings"] = settings
    return state


def make_stream(cfg: SFTConfig, docs: SFTDocuments, state: dict, parallel: ParallelConfig, accum: int, model,
                pad_id: int) -> SFTStream:
    """This rank's data stream at ``state``, padded as the layout needs (``data.stream``)."""
    multiple = token_multiple(model.config)  # TP under sequence parallelism, x 16 for TE's FP8
    return SFTStream(cfg.data, docs, state, steps=cfg.train.steps, accum=accum,
                     dp=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank(), cp=parallel.cp,
                     cp_rank=ps.get_context_parallel_rank(), multiple=multiple, pad_id=pad_id,
                     equal_sizes=parallel.ep * parallel.etp > 1 and model.config.moe_token_dispatcher_type == "allgather",
                     pipeline=parallel.pp > 1, cache_dir=Path(cfg.train.out) / "data_cache",
                     vocab_size=real_vocab_size(model))


def evaluate(ddp, opt, stream: SFTStream) -> float:
    """Mean validation CE per loss token over DP (on the synced parameters: ``synced_params``)."""
    ddp.eval()
    mine = stream.valid()
    with torch.no_grad(), synced_params(ddp, opt):
        s, n = step_losses(ddp, mine, forward_only=True)
    ddp.train()
    return s / max(n, 1)


def train_step(ddp, opt, sched, stream: SFTStream, state: dict, glm5: GLM5Config, accum: int, model,
               moe_load: MoELoad) -> dict:
    """One optimizer step at ``state`` (advanced in place); returns the step's metrics."""
    mine, tokens, after = stream.step(state)
    t0 = time.perf_counter()
    ddp.zero_grad_buffer()
    opt.zero_grad()
    s, n = step_losses(ddp, mine, forward_only=False)
    ok, grad_norm, _ = opt.step()
    sched.step(increment=1)
    dt = time.perf_counter() - t0
    state.update(after)
    state["step"] += 1
    state["tokens"] += tokens
    m = {"loss": s / max(n, 1), "loss_tokens": n, "lr": opt.param_groups[0]["lr"],
         "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
         "tokens_per_s": tokens / dt, "step_time_s": dt, "update_skipped": float(not ok)}
    if stream.indexed:
        m["data/consumed_samples"] = state["sample"]  # Megatron's name: documents drawn so far
    m.update(mtp_depth_losses(glm5.num_nextn_predict_layers, accum))
    m.update(moe_load.metrics())
    m.update(indexer_metrics(model))
    return m


def run(cfg: SFTConfig, record: Optional[Callable[[], None]] = None) -> dict:
    """Train; returns {"history": [per-step metrics], "val": [(step, val_loss)], "data": stats}.
    ``record`` (rank 0) runs once every check passed and ``train.out`` is claimed, before any work: the entry
    point saves the job's config there."""
    source = resolve_model(cfg.model, lora_enabled=cfg.lora.enabled)
    world = int(os.environ.get("WORLD_SIZE", "1")) if not dist.is_initialized() else dist.get_world_size()
    parallel, accum = validate(cfg, source.glm5, world)
    rank0 = (dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))) == 0
    tokenizer = AutoTokenizer.from_pretrained(source.hf_dir)
    if is_indexed(cfg.data):  # tokenized by this model's tokenizer (glm5 data preprocess records it)
        check_tokenizer(cfg.data, tokenizer, source.hf_dir)
    docs = SFTDocuments(cfg.data, tokenizer, report=rank0)
    settings = run_settings(cfg, world)
    claim(cfg, settings, rank0, record)

    model = build(cfg, source, parallel)
    moe_load = MoELoad(model)
    ddp, opt, sched = build_trainer(model, cfg.optim, cfg.train.steps, cfg.train.bf16, cfg.train.cpu_offload)
    state = restore(cfg, model, opt, sched, settings)
    stream = make_stream(cfg, docs, state, parallel, accum, model, tokenizer.pad_token_id or 0)
    log = RunLogger(cfg.wandb, cfg.train.out, asdict(cfg), steps=cfg.train.steps, start_step=state["step"],
                    progress=cfg.train.progress, desc="sft", console_keys=CONSOLE_KEYS, fmt=".4g",
                    active=dist.get_rank() == 0)
    saves = SaveSchedule(cfg.train.save_every, state["step"])
    history, vals = [], []
    eval_every = cfg.train.eval_every if stream.val_mine else 0
    ddp.train()
    try:
        if eval_every and state["step"] == 0:
            vals.append((0, evaluate(ddp, opt, stream)))
            log.log_eval(0, {"val_loss": vals[-1][1]})
        while state["step"] < cfg.train.steps:
            m = train_step(ddp, opt, sched, stream, state, source.glm5, accum, model, moe_load)
            if eval_every and state["step"] % eval_every == 0:
                m["val_loss"] = evaluate(ddp, opt, stream)
                vals.append((state["step"], m["val_loss"]))
            history.append(m)
            log.log(state["step"], m)
            if saves.due(state["step"]):
                with synced_params(ddp, opt):
                    save(cfg, source, model, opt, sched, dict(state))
                saves.done(state["step"])
        if stream.val_mine and (not vals or vals[-1][0] != state["step"]):
            vals.append((state["step"], evaluate(ddp, opt, stream)))
        if saves.final_due(state["step"]):  # the last step, whatever save_every
            with synced_params(ddp, opt):
                save(cfg, source, model, opt, sched, dict(state))
    finally:
        log.close()
    return {"history": history, "val": vals, "data": asdict(docs.stats), "valid_data": asdict(docs.val_stats),
            "state": state}

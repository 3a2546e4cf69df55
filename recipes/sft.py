"""``glm5 sft``: LoRA or full-parameter SFT / continued pretraining of GLM-5 on Megatron-Core.

One process per rank under torchrun (gloo on CPU, NCCL on GPU), or one process alone. Batches are
token budgets: ``global_batch_tokens`` per optimizer step, ``micro_batch_tokens`` per THD-packed
micro-batch, gradient accumulation = global / (micro × DP). The loss is Σ CE over loss tokens
divided by the loss-token count of the whole step summed over DP (Megatron's
``calculate_per_token_loss``), so it does not change with the parallel layout.

``run(cfg)`` takes a plain ``SFTConfig`` (Hydra stops at the entry point, ``recipes.cli``).
"""

from __future__ import annotations

import os
import random
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from glm5_mcore.config import GLM5Config, ParallelConfig
from glm5_mcore.data.order import epoch_order, equal_micro_batch_sizes
from glm5_mcore.device import training_device
from glm5_mcore.lora.apply import LoRAConfig
from glm5_mcore.training.loop import MoELoad, build_trainer, rng_state, set_rng_state
from glm5_mcore.data.sft import DataStats, PackedBatch, pack, pad_to, read_jsonl, split_for_cp
from glm5_mcore.data.indexed import is_jsonl
from recipes.sft_config import DataCfg, LoRACfg, ModelCfg, SFTConfig, TrainCfg  # noqa: F401  (the schema)


def data_inputs(d: "DataCfg") -> list[str]:
    """The indexed-dataset prefixes named by ``data.blend`` (none for jsonl runs)."""
    if not d.blend:
        return []
    from glm5_mcore.data.indexed import parse_blend

    return parse_blend(d.blend)[0]


def data_fingerprint(path: Optional[str]):
    """A jsonl file's size + digest; an indexed dataset's ``.idx`` digest (every document's length)
    and ``.bin`` size, without reading the corpus."""
    from glm5_mcore.training.resume import file_fingerprint

    if not path or is_jsonl(path):
        return file_fingerprint(path)
    from glm5_mcore.data.indexed import resolve_prefix

    try:
        prefix = resolve_prefix(path)
    except FileNotFoundError:
        return path
    return {"idx": file_fingerprint(f"{prefix}.idx"), "bin_size": Path(f"{prefix}.bin").stat().st_size}


def run_settings(cfg: SFTConfig, world: int) -> dict:
    """What a resume must keep (``glm5_mcore.training.resume``): data, batch sizes, LoRA, model, layout."""
    from glm5_mcore.training.resume import model_fingerprint

    d, lo = cfg.data, cfg.lora
    return {
        "data": {"train": data_fingerprint(d.train), "valid": data_fingerprint(d.valid),
                 "blend": [data_fingerprint(x) for x in data_inputs(d)], "split": d.split,
                 "micro_batch_tokens": d.micro_batch_tokens, "global_batch_tokens": d.global_batch_tokens,
                 "max_tokens": d.max_tokens, "seed": d.seed},
        "lora": {"enabled": lo.enabled, "name": lo.name, "rank": lo.rank, "alpha": lo.alpha,
                 "targets": sorted(lo.targets)} if lo.enabled else {"enabled": False},
        "model": model_fingerprint(cfg.model.hf_dir, cfg.model.ckpt),
        "layout": {"world_size": world, **{k: getattr(cfg.parallel, k) for k in ("tp", "ep", "cp", "pp")}},
    }


# --------------------------------------------------------------------------------------------------
# checks that run before any work
# --------------------------------------------------------------------------------------------------
def validate(cfg: SFTConfig, glm5: GLM5Config, world: int) -> tuple[ParallelConfig, int]:
    """The parallel layout and gradient-accumulation count; ValueErrors name the field."""
    parallel = cfg.parallel
    glm5.to_mcore_config(parallel)  # heads % tp, experts % ep, ...: ValueError naming the field
    if parallel.pp > 1 and glm5.num_hidden_layers % parallel.pp:
        raise ValueError(f"parallel.pp={parallel.pp} does not divide num_hidden_layers={glm5.num_hidden_layers}")
    if world % (parallel.tp * parallel.cp * parallel.pp):
        raise ValueError(f"parallel.tp*cp*pp={parallel.tp * parallel.cp * parallel.pp} does not divide the "
                         f"world size {world}")
    dp = world // (parallel.tp * parallel.cp * parallel.pp)
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
    if d.blend or not is_jsonl(d.train):  # indexed: every prefix exists, the blend parses
        from glm5_mcore.data.indexed import check_data

        check_data(d)
    elif d.split:
        raise ValueError("data.split: splits indexed datasets; for jsonl give data.valid")
    elif d.valid and not is_jsonl(d.valid):
        raise ValueError(f"data.valid={d.valid}: jsonl training data needs jsonl validation data")
    if not torch.cuda.is_available():
        if cfg.optim.distributed:
            raise ValueError("optim.distributed: the distributed optimizer reduce-scatters gradients, which "
                             "gloo (CPU) does not implement")
        for flag, why in (("bf16", "Megatron's Float16Optimizer wraps CUDA tensors"),
                          ("recompute", "activation recompute restores the CUDA RNG state"),
                          ("cpu_offload", "optimizer offload moves CUDA states to host")):
            if getattr(cfg.train, flag):
                raise ValueError(f"train.{flag}: needs CUDA ({why}); CPU runs are fp32 without it")
    if cfg.train.steps < 1:
        raise ValueError("train.steps must be >= 1")
    _check_indexer_settings(cfg)
    return parallel, d.global_batch_tokens // (d.micro_batch_tokens * dp)


def _check_indexer_settings(cfg: SFTConfig) -> None:
    """A trainable indexer needs a loss: the LM loss never reaches it (its top-k is not differentiable)."""
    from glm5_mcore.lora.apply import INDEXER

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
    from megatron.core import parallel_state as ps

    from glm5_mcore.training.loop import forward_backward

    res = forward_backward(ddp, _forward_step, batches, forward_only, max(b.num_tokens for b in batches))
    tot = torch.zeros(2, device=training_device())
    for r in res:  # only the last pipeline stage computes the loss
        tot += r["lm"].float()
    group = ps.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(tot, group=group)
    if ps.get_pipeline_model_parallel_world_size() > 1:
        dist.all_reduce(tot, group=ps.get_pipeline_model_parallel_group())
    return float(tot[0]), float(tot[1])


def _equalize(batches: list[PackedBatch], pad_id: int) -> list[PackedBatch]:
    """Pad micro-batch i of every rank to the largest micro-batch i over all ranks (and equal counts)."""
    from glm5_mcore.data.sft import pad_to

    sizes = equal_micro_batch_sizes([b.num_tokens for b in batches])
    if len(sizes) != len(batches):
        raise RuntimeError("ranks disagree on the number of micro-batches per step")
    return [pad_to(b, n, pad_id) for b, n in zip(batches, sizes)]


# --------------------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------------------
def save(cfg: SFTConfig, model, opt, sched, state: dict) -> None:
    from glm5_mcore.checkpoint.layout import prune_iterations, save_checkpoint, write_hf_meta

    out = Path(cfg.train.out)
    adapters = None
    if cfg.lora.enabled:
        adapters = {cfg.lora.name: LoRAConfig(rank=cfg.lora.rank, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
                                              targets=tuple(cfg.lora.targets))}
    rank_state = {"scheduler": sched.state_dict(), "rng": rng_state()}
    save_checkpoint(out, state["step"], model, state, adapters=adapters, save_base=not cfg.lora.enabled,
                    rank_state=rank_state, optimizer=opt)
    if dist.get_rank() == 0:
        if not (out / "hf").is_dir():
            write_hf_meta(out / "hf", _hf_dir(cfg), base_ckpt=cfg.model.ckpt)
        prune_iterations(out, cfg.train.keep_last)
    dist.barrier()


def _model_config(cfg: SFTConfig, hf_dir: str) -> tuple[GLM5Config, bool]:
    """The model to build for ``model.mtp`` and whether its MTP layers start fresh (not loaded)."""
    import dataclasses

    from glm5_mcore.checkpoint.folder_config import run_model_config

    mode = cfg.model.mtp
    if mode not in ("auto", "init", "off"):
        raise ValueError(f"model.mtp: expected auto, init or off, got {mode!r}")
    declared = GLM5Config.from_hf_dir(hf_dir)
    if mode == "off":
        return dataclasses.replace(declared, num_nextn_predict_layers=0), False
    if mode == "init" and declared.num_nextn_predict_layers == 0:
        raise ValueError(f"model.mtp=init: {hf_dir}/config.json declares num_nextn_predict_layers=0")
    stored = run_model_config(cfg.model.ckpt, hf_dir, quiet=mode == "init")  # a Megatron-LM ckpt: against hf_dir
    if mode == "auto" or stored.num_nextn_predict_layers == declared.num_nextn_predict_layers:
        return stored, False
    if cfg.lora.enabled:
        raise ValueError("model.mtp=init trains a whole fresh MTP layer, which a LoRA run neither trains nor "
                         "saves: set lora.enabled=false (or model.mtp=auto)")
    if stored.num_nextn_predict_layers or cfg.model.ckpt:
        raise ValueError(f"model.mtp=init: {cfg.model.ckpt or hf_dir} stores {stored.num_nextn_predict_layers} of "
                         f"{declared.num_nextn_predict_layers} MTP layers; init starts all of them fresh from an "
                         "HF folder (model.hf_dir) that stores none")
    from glm5_mcore.checkpoint.folder_config import notice

    notice(f"{hf_dir}: model.mtp=init: {declared.num_nextn_predict_layers} MTP layer(s) initialised fresh and trained")
    return declared, True


def _hf_dir(cfg: SFTConfig) -> str:
    if cfg.model.hf_dir:
        return cfg.model.hf_dir
    if cfg.model.ckpt:
        from glm5_mcore.checkpoint.megatron_lm import is_foreign

        if is_foreign(cfg.model.ckpt):
            raise ValueError(f"model.ckpt={cfg.model.ckpt}: a Megatron-LM / Megatron-Bridge checkpoint; give "
                             "model.hf_dir too (the HF config and tokenizer)")
        return str(Path(cfg.model.ckpt) / "hf")
    raise ValueError("model.hf_dir or model.ckpt must be given")


@torch.no_grad()
def _restore(cfg: SFTConfig, model, opt, sched, settings: dict) -> Optional[dict]:
    """Resume from ``train.out`` if it has a checkpoint saved with the same ``settings`` (or
    ``train.allow_resume_mismatch``): weights/adapters in place, optimizer, scheduler, RNG and data
    position. Returns the trainer state or None."""
    from glm5_mcore.lora.state import read_adapter_state
    from glm5_mcore.checkpoint.layout import (adapter_dir, iter_dir, latest_iteration, load_model, load_optimizer,
                                       load_rank_state, read_trainer_state)
    from glm5_mcore.lora.apply import lora_layers
    from glm5_mcore.training.resume import guard_resume

    out = Path(cfg.train.out)
    if not cfg.train.resume:
        return None
    it = guard_resume(out, settings, cfg.train.allow_resume_mismatch, "train")
    if it is None:
        return None
    if cfg.lora.enabled:
        path = adapter_dir(out, cfg.lora.name, it)
        st = read_adapter_state(path)
        for _, _, lora in lora_layers(model):
            if lora.module_name not in st.A:
                raise ValueError(f"{path}: no adapter for {lora.module_name} (saved with other lora.targets?)")
            try:
                lora.load_full_(cfg.lora.name, st.A[lora.module_name], st.B[lora.module_name])
            except RuntimeError as e:  # another rank: a size mismatch
                raise ValueError(f"{path}: adapter {lora.module_name} does not fit this run "
                                 f"({' '.join(str(e).split())[:160]})") from None
    else:
        load_model(model, iter_dir(out, it) / "model")
    rs = load_rank_state(out, it, dist.get_rank())
    load_optimizer(opt, model, iter_dir(out, it) / "optimizer" / "dist")
    try:
        sched.load_state_dict(rs["scheduler"])
    except (KeyError, ValueError, RuntimeError) as e:
        raise ValueError(f"{iter_dir(out, it) / 'optimizer'}: scheduler state does not fit this run "
                         f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
    set_rng_state(rs["rng"])
    state = read_trainer_state(out, it)
    state["settings"] = settings
    return state


# --------------------------------------------------------------------------------------------------
# the run
# --------------------------------------------------------------------------------------------------
class _Logger:
    """The run's metrics (W&B, offline unless a project/mode is set, and ``train.out/metrics.jsonl``:
    ``glm5_mcore.training.run_log``) + a console progress bar, rank 0 only."""

    def __init__(self, cfg: SFTConfig, start_step: int = 0):
        from glm5_mcore.training.run_log import RunLog

        self.rank0 = dist.get_rank() == 0
        self.run = None
        self.bar = None
        if not self.rank0:
            return
        self.run = RunLog(cfg.wandb, cfg.train.out, asdict(cfg), start_step)
        if cfg.train.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=cfg.train.steps, initial=start_step, desc="sft", dynamic_ncols=True)

    def log(self, step: int, metrics: dict) -> None:
        if not self.rank0:
            return
        self.run.log(step, metrics)
        if self.bar is not None:
            self.bar.n = step
            keys = ("loss", "val_loss", "mtp_loss/depth_1", "indexer/loss", "indexer/recall", "moe/max_over_mean",
                    "lr", "grad_norm", "tokens_per_s")
            self.bar.set_postfix({k.split("/")[0] if k.endswith("depth_1") else k: f"{metrics[k]:.4g}"
                                  for k in keys if k in metrics}, refresh=True)

    def log_eval(self, step: int, metrics: dict) -> None:
        """An evaluation outside a training step (before the first one): the metrics sinks only."""
        if self.rank0:
            self.run.log(step, metrics)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.run is not None:
            self.run.close()


def run(cfg: SFTConfig, record: Optional[Callable[[], None]] = None) -> dict:
    """Train; returns {"history": [per-step metrics], "val": [(step, val_loss)], "data": stats}.
    ``record`` (rank 0) runs once every check passed and ``train.out`` is claimed, before any work: the entry
    point saves the job's config there."""
    from megatron.core import parallel_state as ps
    from transformers import AutoTokenizer

    from glm5_mcore.checkpoint.layout import load_model, model_dir
    from glm5_mcore.model.dsa import (check_indexer_learns, indexer_metrics, set_indexer_frozen, set_indexer_warmup,
                                set_recall_probe)
    from glm5_mcore.lora.apply import apply_lora
    from glm5_mcore.model.build import build_model, init_parallel, load_hf_weights
    from glm5_mcore.model.mtp_loss import mtp_depth_losses
    from glm5_mcore.training.resume import claim_run_dir, guard_resume

    hf_dir = _hf_dir(cfg)
    glm5, fresh_mtp = _model_config(cfg, hf_dir)
    world = int(os.environ.get("WORLD_SIZE", "1")) if not dist.is_initialized() else dist.get_world_size()
    parallel, accum = validate(cfg, glm5, world)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    stats, val_stats = DataStats(), DataStats()
    indexed = bool(cfg.data.blend) or not is_jsonl(cfg.data.train)  # Megatron indexed datasets
    docs = None if indexed else read_jsonl(cfg.data.train, tokenizer, cfg.data.max_tokens, cfg.data.skip_bad_rows,
                                           stats)
    val_docs = (read_jsonl(cfg.data.valid, tokenizer, cfg.data.max_tokens, cfg.data.skip_bad_rows, val_stats)
                if cfg.data.valid and not indexed else None)
    rank0 = (dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))) == 0
    if (stats.truncated or val_stats.truncated) and rank0:
        print(f"sft: {stats.truncated} training and {val_stats.truncated} validation row(s) longer than "
              f"data.max_tokens={cfg.data.max_tokens} were cut to it (their last tokens not trained), "
              f"first: {(stats.truncated_rows or val_stats.truncated_rows)[0]}", file=sys.stderr)
    settings = run_settings(cfg, world)
    if rank0:
        claim_run_dir(cfg.train.out, "sft", [cfg.model.hf_dir, cfg.model.ckpt, cfg.data.train, cfg.data.valid,
                                             *data_inputs(cfg.data)])
    if cfg.train.resume:  # refuse changed settings before any work
        guard_resume(cfg.train.out, settings, cfg.train.allow_resume_mismatch, "train")
    if record is not None and rank0:
        record()

    init_parallel(parallel, seed=cfg.train.seed)
    random.seed(cfg.train.seed)
    overrides = dict(calculate_per_token_loss=True, mtp_loss_scaling_factor=cfg.train.mtp_loss_scale,
                     moe_router_bias_update_rate=cfg.train.moe_bias_update_rate,
                     dsa_indexer_loss_coeff=0.0 if cfg.train.freeze_indexer else cfg.train.indexer_loss_coeff)
    if cfg.train.moe_aux_loss_coeff > 0:
        overrides.update(moe_aux_loss_coeff=cfg.train.moe_aux_loss_coeff, moe_router_load_balancing_type="seq_aux_loss")
    if cfg.train.bf16:
        overrides.update(bf16=True, params_dtype=torch.bfloat16)
    if cfg.train.recompute:
        overrides.update(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    if cfg.model.ckpt:
        from glm5_mcore.checkpoint import megatron_lm as foreign_ckpt

        if foreign_ckpt.is_foreign(cfg.model.ckpt):  # Megatron-LM / Bridge: config checked, MTP as stored
            glm5 = foreign_ckpt.glm5_config(cfg.model.ckpt, glm5)
    model = build_model(glm5, parallel, **overrides)
    if cfg.model.ckpt:
        load_model(model, model_dir(cfg.model.ckpt))
    else:
        load_hf_weights(model, hf_dir, glm5, skip_prefixes=("mtp.",) if fresh_mtp else ())
    if cfg.train.indexer_warmup:
        if cfg.lora.enabled:
            raise ValueError("train.indexer_warmup trains the indexer alone: set lora.enabled=false")
        for p in model.parameters():
            p.requires_grad_(False)
        set_indexer_frozen(model, False)
        set_indexer_warmup(model, cfg.train.indexer_loss_coeff)
    elif cfg.lora.enabled:
        apply_lora(model, LoRAConfig(rank=cfg.lora.rank, alpha=cfg.lora.alpha, dropout=cfg.lora.dropout,
                                     targets=tuple(cfg.lora.targets), seed=cfg.train.seed), cfg.lora.name,
                   freeze_indexer=cfg.train.freeze_indexer)
    else:
        set_indexer_frozen(model, cfg.train.freeze_indexer)
    check_indexer_learns(model)
    set_recall_probe(model)  # indexer/recall also with a frozen indexer: how far attention drifts from it
    moe_load = MoELoad(model)
    ddp, opt, sched = build_trainer(model, cfg.optim, cfg.train.steps, cfg.train.bf16, cfg.train.cpu_offload)
    state = _restore(cfg, model, opt, sched, settings) or {"step": 0, "epoch": 0, "cursor": 0, "sample": 0,
                                                             "tokens": 0, "settings": settings}
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    cp_rank = ps.get_context_parallel_rank()
    multiple = parallel.tp if model.config.sequence_parallel else 1
    pad_id = tokenizer.pad_token_id or 0
    if indexed:  # samples read lazily by index; state["sample"] is the next one
        from glm5_mcore.data.indexed import IndexedData

        data = IndexedData(cfg.data, cfg.train.steps, accum, dp, dp_rank, multiple, pad_id,
                           str(Path(cfg.train.out) / "data_cache"), state.setdefault("sample", 0))
        val_mine = data.valid_batches()
    else:
        packs = pack([docs[i] for i in epoch_order(len(docs), cfg.data.seed, state["epoch"])],
                     cfg.data.micro_batch_tokens, multiple, pad_id)
        if len(packs) < accum * dp:
            raise ValueError(f"data.train: one epoch packs into {len(packs)} micro-batches, a step needs "
                             f"{accum * dp} (lower data.global_batch_tokens)")
        val_packs = pack(val_docs, cfg.data.micro_batch_tokens, multiple, pad_id) if val_docs else []
        val_mine = val_packs[dp_rank::dp] or val_packs[:1]
    # Megatron's allgather token dispatcher (the CPU one) gathers every EP rank's tokens with equal
    # sizes: pad each micro-batch to the largest of its peers (a masked filler document).
    equal_sizes = parallel.ep > 1 and model.config.moe_token_dispatcher_type == "allgather"
    # Pipeline stages exchange activations of one fixed shape [micro_batch_tokens, 1, H] (the
    # allgather dispatcher rules out Megatron's variable_seq_lengths): every pack is padded to it.
    fixed_tokens = (-(-cfg.data.micro_batch_tokens // multiple) * multiple) if parallel.pp > 1 else 0
    log = _Logger(cfg, state["step"])
    history, vals = [], []

    def validate_now() -> float:
        ddp.eval()
        mine = val_mine
        if fixed_tokens:
            mine = [pad_to(b, fixed_tokens, pad_id) for b in mine]
        elif equal_sizes:
            mine = _equalize(mine, pad_id)
        mine = [split_for_cp(b, parallel.cp, cp_rank, pad_id, multiple) for b in mine]
        with torch.no_grad():
            s, n = step_losses(ddp, mine, forward_only=True)
        ddp.train()
        return s / max(n, 1)

    ddp.train()
    try:
        if val_mine and cfg.train.eval_every and state["step"] == 0:
            vals.append((0, validate_now()))
            log.log_eval(0, {"val_loss": vals[-1][1]})
        while state["step"] < cfg.train.steps:
            if indexed:
                mine, tokens, next_sample = data.step(state["sample"])
            else:
                if state["cursor"] + accum * dp > len(packs):
                    state["epoch"] += 1
                    state["cursor"] = 0
                    packs = pack([docs[i] for i in epoch_order(len(docs), cfg.data.seed, state["epoch"])],
                                 cfg.data.micro_batch_tokens, multiple, pad_id)
                step_batches = packs[state["cursor"]: state["cursor"] + accum * dp]
                mine = step_batches[dp_rank * accum: (dp_rank + 1) * accum]
                tokens, next_sample = sum(b.num_tokens for b in step_batches), state.get("sample", 0)
            if fixed_tokens:
                mine = [pad_to(b, fixed_tokens, pad_id) for b in mine]
            elif equal_sizes:
                mine = _equalize(mine, pad_id)
            mine = [split_for_cp(b, parallel.cp, cp_rank, pad_id, multiple) for b in mine]
            t0 = time.perf_counter()
            ddp.zero_grad_buffer()
            opt.zero_grad()
            s, n = step_losses(ddp, mine, forward_only=False)
            ok, grad_norm, _ = opt.step()
            sched.step(increment=1)
            dt = time.perf_counter() - t0
            state["cursor"] += 0 if indexed else accum * dp
            state["sample"] = next_sample
            state["step"] += 1
            state["tokens"] += tokens
            loss = s / max(n, 1)
            m = {"loss": loss, "loss_tokens": n, "lr": opt.param_groups[0]["lr"],
                 "grad_norm": float(grad_norm) if grad_norm is not None else float("nan"),
                 "tokens_per_s": tokens / dt, "step_time_s": dt, "update_skipped": float(not ok)}
            if indexed:
                m["data/consumed_samples"] = next_sample  # Megatron's name: documents drawn so far
            m.update(mtp_depth_losses(glm5.num_nextn_predict_layers, accum))
            m.update(moe_load.metrics())
            m.update(indexer_metrics(model))
            if val_mine and cfg.train.eval_every and state["step"] % cfg.train.eval_every == 0:
                m["val_loss"] = validate_now()
                vals.append((state["step"], m["val_loss"]))
            history.append(m)
            log.log(state["step"], m)
            if cfg.train.save_every and state["step"] % cfg.train.save_every == 0:
                save(cfg, model, opt, sched, dict(state))
        if val_mine and (not vals or vals[-1][0] != state["step"]):
            vals.append((state["step"], validate_now()))
    finally:
        log.close()
    return {"history": history, "val": vals, "data": asdict(stats), "valid_data": asdict(val_stats), "state": state}

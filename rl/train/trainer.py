"""One trainer rank: GLM-5 on Megatron-Core with the policy LoRA adapter (and, for GAE, the
critic: a value head + its own adapter "critic" on the same frozen base), the indexer frozen.

It runs in-process (tests) or inside a Ray actor (``rl.cluster.trainer_group``); all ranks of a run form one
torch.distributed group (gloo on CPU, NCCL on GPU) with Megatron's TP/EP/DP groups. Sequences are
THD-packed (prompt + response per document) into micro-batches filled to a token budget
(``rl.train.micro_batch``: verl's ``use_dynamic_bsz``): ``actor.log_prob_micro_batch_tokens`` for the forward-only
passes, ``actor.micro_batch_tokens`` for the update; samples balanced over DP ranks, the same number of
micro-batches on every rank.

- ``compute_log_probs``: old log-probs (policy adapter), reference log-probs (adapters disabled —
  the same weights, no second model), critic values; forward only.
- ``update``: PPO epochs over mini-batches; per micro-batch verl's policy loss (rollout-correction
  weights multiplied in per token) + KL loss + entropy bonus + value loss, aggregated with verl's
  ``agg_loss`` over the *mini-batch's* global token / sequence counts; Megatron's schedule does the
  backward and DP reduction in its per-token form (``calculate_per_token_loss``, as SFT: the gradients
  divided by the mini-batch's response tokens), which the MTP loss takes too (``rl.train.mtp.PerTokenMTP``).
  A non-finite loss or gradient skips the optimizer step with a reason.
- ``export_adapter``: the policy adapter as an HF PEFT payload (the rollout engines' weight sync).
- Expert load (tokens per expert, max/mean per MoE layer) of each update is in its metrics.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from megatron.core import parallel_state as ps
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from transformers import AutoTokenizer

from glm5_mcore.checkpoint.layout import latest_iteration
from glm5_mcore.mcore_settings import recompute_overrides, token_multiple
from glm5_mcore.device import training_device
from glm5_mcore.lora.apply import apply_lora, disable_adapters, set_adapter
from glm5_mcore.lora.peft import peft_files
from glm5_mcore.lora.state import gather_adapter
from glm5_mcore.model.build import build_model
from glm5_mcore.model.dsa import keeping_topk
from glm5_mcore.model.indexer_stages import check_indexer_learns
from glm5_mcore.model.mtp_loss import fp32_output_layer, token_logprobs
from glm5_mcore.model.parallel import init_parallel
from glm5_mcore.training.checkpointing import restore_run, save_run
from glm5_mcore.training.loop import MoELoad, OptimCfg, build_trainer, forward_backward, synced_params
from glm5_mcore.training.model_source import resolve_model
from rl.train.algos import ActorLoss
from rl.train.batch import RolloutBatch
from rl.config import RLConfig
from rl.train.offload import TrainerOffload
from rl.train.cp import RLContextParallel
from rl.train.critic import ValueHead
from rl.train.micro_batch import PackedMicroBatch, check_fits, pack_micro_batches, sample_lengths
from rl.train.mtp import (DraftAcceptance, PerTokenMTP, drafted_positions, freeze_mtp_adapters, mtp_layers,
                          mtp_loss_off, real_token_mask)
from rl.rollout.base import AdapterPayload
from rl.train.routing import TrainerRouting, index_topk_counts


class PolicyTrainer:
    def __init__(self, cfg: RLConfig, rank: int = 0, world: int = 1, master_addr: Optional[str] = None,
                 master_port: Optional[int] = None):
        if master_addr is not None:
            os.environ.update(MASTER_ADDR=str(master_addr), MASTER_PORT=str(master_port), RANK=str(rank),
                              WORLD_SIZE=str(world), LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"))
        self.cfg = cfg
        t = cfg.trainer
        self.parallel = t.parallel()
        self.source = resolve_model(cfg.model)  # HF folder, our checkpoint or a Megatron-LM / Bridge one
        self.glm5 = self.source.glm5
        # the MTP block: trained with actor.mtp_loss_scale > 0, measured only with actor.mtp_accept
        mtp = mtp_layers(cfg.actor.mtp_loss_scale, self.glm5, cfg.model.ckpt or cfg.model.hf_dir,
                         cfg.actor.mtp_accept)
        overrides_mtp = {"mtp_loss_scaling_factor": cfg.actor.mtp_loss_scale} if mtp else {}
        init_parallel(self.parallel, seed=t.seed)
        self.pad_id = AutoTokenizer.from_pretrained(cfg.model.hf_dir).pad_token_id or 0
        overrides = {"calculate_per_token_loss": True}
        if t.bf16:
            overrides.update(bf16=True, params_dtype=torch.bfloat16)
        overrides.update(recompute_overrides(t.recompute))
        model = build_model(self.glm5, self.parallel, backend=t.backend, mtp_num_layers=mtp,
                            dsa_kernel_backend=cfg.model.dsa_kernel_backend,
                            moe_grouped_gemm=cfg.model.moe_grouped_gemm, base_fp8_block=self.source.base_fp8_block,
                            moe_enable_routing_replay=True, **overrides, **overrides_mtp)
        self.source.load_weights(model)
        self.lora_cfg = {"default": cfg.lora.to_lora_config(seed=t.seed)}
        apply_lora(model, self.lora_cfg["default"], "default", freeze_indexer=t.freeze_indexer)
        self.value_head = None
        if cfg.use_critic:
            self.lora_cfg["critic"] = cfg.critic.lora.to_lora_config(seed=t.seed + 1)
            apply_lora(model, self.lora_cfg["critic"], "critic", freeze_indexer=t.freeze_indexer)
            model.value_head = self.value_head = ValueHead(self.glm5.hidden_size).to(training_device())
            self._hidden = None
            model.output_layer.register_forward_pre_hook(self._capture_hidden)
        set_adapter(model, "default")
        if mtp and not cfg.actor.mtp_loss_scale:
            freeze_mtp_adapters(model)  # MTP block built to measure rollout/mtp_accept only
        check_indexer_learns(model, "trainer.freeze_indexer")
        fp32_output_layer(model)  # log-probs from fp32 logits under bf16 (old, ref, new: IcePop's ratios)
        self.model = model
        self.multiple = token_multiple(model.config)  # TP under sequence parallelism, x 16 for TE's FP8
        self.cp = RLContextParallel(self.multiple)
        self.routing = TrainerRouting(model, replay=cfg.algorithm.router_replay)
        self.mtp = DraftAcceptance(model) if mtp else None
        self.mtp_loss = PerTokenMTP(model, cfg.actor.mtp_loss_scale, mtp) if mtp else None
        self.moe_load = MoELoad(model)
        a = cfg.actor
        self.ddp, self.opt, self.sched = build_trainer(model, OptimCfg(
            lr=a.lr, weight_decay=a.weight_decay, clip_grad=a.clip_grad, adam_beta1=a.adam_beta1,
            adam_beta2=a.adam_beta2, decay_style="constant", overlap_grad_reduce=a.overlap_grad_reduce,
            overlap_param_gather=a.overlap_param_gather), t.steps,
            bf16=t.bf16)
        self.loss = ActorLoss(cfg)
        co = cfg.rollout.colocate
        self.offloader = TrainerOffload(self.ddp, self.opt, model, co.offload_weights) if co.enable else None

    # ------------------------------------------------------------------ helpers
    def _capture_hidden(self, _mod, args):
        self._hidden = args[0]

    @property
    def reports(self) -> bool:
        """Whether this rank's results are the ones the driver reads (TP and CP rank 0)."""
        return ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0

    def _dp(self) -> tuple[int, int]:
        return ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()

    def _micro_batches(self, batch: RolloutBatch, rows: list[int], forward_only: bool = False
                       ) -> list[PackedMicroBatch]:
        """This DP rank's micro-batches of ``rows`` (every DP rank's samples: the whole batch or a
        mini-batch), planned by ``rl.train.micro_batch`` within ``actor.micro_batch_tokens`` (the update) or
        ``actor.log_prob_micro_batch_tokens`` (``forward_only``); a sample longer than the budget is refused
        with one line."""
        a = self.cfg.actor
        budget, field = a.micro_batch_tokens, "actor.micro_batch_tokens"
        if forward_only and a.log_prob_micro_batch_tokens is not None:
            budget, field = a.log_prob_micro_batch_tokens, "actor.log_prob_micro_batch_tokens"
        cp = self.cp if self.cp.size > 1 else None
        check_fits(batch, rows, budget, field, cp)  # every rank holds the same batch: all refuse together
        dp, dp_rank = self._dp()
        return pack_micro_batches(batch, rows, budget, self.pad_id, cp, self.multiple,
                                  (len(self.routing.instances), self.routing.top_k), dp, dp_rank)

    def _logprobs(self, model, mb: PackedMicroBatch, temperature: float):
        """(log p [n, R], entropy [n, R]) of each response token under ``model``'s active adapter."""
        dev = training_device()
        self.routing.prepare(mb.routes, dev)
        self.moe_load.token_mask = self.routing.tp_slice(mb.real_mask) if self.routing.routers else None
        kw = {"loss_mask": real_token_mask(mb.num_tokens, mb.real_tokens, dev)} if self.mtp is not None else {}
        logits = model(input_ids=mb.input_ids.to(dev), position_ids=mb.position_ids.to(dev), attention_mask=None,
                       packed_seq_params=mb.packed_seq_params(dev), **kw)[0]  # [T, V/TP]
        group = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
        logp, ent = token_logprobs(logits, mb.targets.to(dev), group, temperature)
        if mb.unsplit is not None:  # CP: every rank's tokens, in the unsplit order
            logp, ent = self.cp.gather(torch.stack([logp, ent], -1), mb).unbind(-1)
        pos = mb.pos.to(dev)
        return logp[pos], ent[pos]

    def _values(self, model, mb: PackedMicroBatch) -> torch.Tensor:
        set_adapter(self.model, "critic")
        dev = training_device()
        self.routing.prepare(mb.routes, dev)
        self.moe_load.token_mask = self.routing.tp_slice(mb.real_mask) if self.routing.routers else None
        try:
            with mtp_loss_off(self.model) if self.mtp is not None else contextlib.nullcontext():
                model(input_ids=mb.input_ids.to(dev), position_ids=mb.position_ids.to(dev), attention_mask=None,
                      packed_seq_params=mb.packed_seq_params(dev))
        finally:
            set_adapter(self.model, "default")
        h = self._hidden  # [T, 1, H]
        if self.model.config.sequence_parallel:
            # every TP rank computes the same value loss: a split backward, not a reduce-scatter (2x grads)
            h = gather_from_sequence_parallel_region(h, tensor_parallel_output_grad=False)
        v = self.value_head(h)[:, 0]
        if mb.unsplit is not None:
            v = self.cp.gather(v, mb)
        return v[mb.pos.to(dev)]

    # ------------------------------------------------------------------ forward only
    @torch.no_grad()
    def compute_log_probs(self, batch: RolloutBatch, ref: bool = True) -> Optional[dict]:
        """{"rows": sample indices, "old_log_probs", "ref_log_probs", "values": [n, R]} for this
        rank's DP share (None on non-reporting ranks)."""
        T = self.cfg.rollout.temperature
        self.ddp.eval()
        out = {"rows": [], "old_log_probs": [], "ref_log_probs": [], "values": []}
        agree, index_agree = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
        for mb in self._micro_batches(batch, list(range(batch.size)), forward_only=True):
            if self.mtp is not None:  # rollout/mtp_accept from the MTP logits this forward computes anyway
                self.mtp.arm(mb.input_ids.to(training_device()),
                             drafted_positions(mb.pos, [len(batch.responses[i]) for i in mb.rows]))
            with keeping_topk(self.model) if batch.index_topk is not None else contextlib.nullcontext():
                old, _ = self._logprobs(self.ddp, mb, T)
                if batch.index_topk is not None:
                    index_agree += index_topk_counts(self.model, batch, mb.rows, mb if mb.unsplit is not None else None)
            out["old_log_probs"].append(old)
            if mb.routes is not None:
                agree += self.routing.agreement(mb.routes, mb.routes_valid).cpu()
            if ref:
                with disable_adapters(self.model):
                    out["ref_log_probs"].append(self._logprobs(self.ddp, mb, T)[0])
            if self.value_head is not None:
                out["values"].append(self._values(self.ddp, mb))
            out["rows"] += mb.rows
        self.ddp.train()
        self.routing.clear()
        if self.cp.size > 1:  # each CP rank counted the tokens it holds
            both = self.cp.sum(torch.cat([agree, index_agree]).to(training_device())).cpu()
            agree, index_agree = both[:2], both[2:]
        if not self.reports:
            return None
        res = {k: (torch.cat(v).float().cpu() if v and k != "rows" else v) for k, v in out.items()}
        res["router_agree"] = agree if batch.routes is not None else None
        res["index_topk_agree"] = index_agree if batch.index_topk is not None else None
        return res

    # ------------------------------------------------------------------ update
    def update(self, batch: RolloutBatch, step: int) -> Optional[dict]:
        """PPO epochs × mini-batches of ``actor.ppo_mini_batch_size`` prompts; returns averaged metrics."""
        a = self.cfg.actor
        dp, _ = self._dp()
        n = self.cfg.rollout.n
        n_prompts = batch.size // n
        sums: dict[str, float] = {}
        weights: dict[str, float] = {}
        skipped, reasons, grad_norms = 0, [], []
        self.moe_load.counts = {}  # count the update's routing only
        t0 = time.perf_counter()
        for epoch in range(a.ppo_epochs):
            g = torch.Generator().manual_seed(self.cfg.trainer.seed * 7919 + step * 31 + epoch)
            order = torch.randperm(n_prompts, generator=g).tolist()
            for m0 in range(0, n_prompts, a.ppo_mini_batch_size):
                prompts = order[m0: m0 + a.ppo_mini_batch_size]
                mb_rows = sorted(p * n + k for p in prompts for k in range(n))
                mask = batch.response_mask[mb_rows]
                gbi = {"dp_size": dp, "batch_num_tokens": int(mask.sum()),
                       "global_batch_size": int((mask.sum(-1) > 0).sum())}
                if not gbi["batch_num_tokens"]:  # every response masked or rejected: no loss to take a step on
                    skipped += 1
                    reasons.append("no response token left in the loss (masked or rejected)")
                    continue
                micro = self._micro_batches(batch, mb_rows)
                if self.mtp_loss is not None:
                    self.mtp_loss.mini_batch(sample_lengths(batch, mb_rows), self._divisor(gbi))
                packed = sum(m.packed_tokens for m in micro)
                plan = {"actor/micro_batches": (len(micro), 1.0),  # per mini-batch (every rank alike)
                        "actor/micro_batch_fill": (sum(m.used_tokens for m in micro) / packed, packed)}
                for k, (v, w) in plan.items():  # fill: the share of packed tokens that is not filler
                    sums[k], weights[k] = sums.get(k, 0.0) + v * w, weights.get(k, 0.0) + w
                self.ddp.zero_grad_buffer()
                self.opt.zero_grad()
                reports = forward_backward(self.ddp, self._train_step(batch, gbi, len(micro)), micro,
                                           forward_only=False, seq_length=max(m.num_tokens for m in micro))
                ok, why = self._finite(reports)
                if ok:
                    success, grad_norm, _ = self.opt.step()
                    self.sched.step(increment=1)
                    grad_norms.append(float(grad_norm) if grad_norm is not None else float("nan"))
                else:
                    skipped += 1
                    reasons.append(why)
                    self.ddp.zero_grad_buffer()
                    self.opt.zero_grad()
                for r in reports:
                    for k, (v, w) in r.items():
                        sums[k] = sums.get(k, 0.0) + v * w
                        weights[k] = weights.get(k, 0.0) + w
        self.routing.clear()
        keys = sorted(sums)
        t = torch.tensor([[sums[k], weights[k]] for k in keys], dtype=torch.float64,
                         device=training_device()).reshape(-1, 2)
        if dp > 1:
            dist.all_reduce(t, group=ps.get_data_parallel_group())
        metrics = {k: float(t[i, 0] / max(t[i, 1], 1e-12)) for i, k in enumerate(keys)}
        metrics.update({"actor/grad_norm": float(np.mean(grad_norms)) if grad_norms else float("nan"),
                        "actor/lr": self.opt.param_groups[0]["lr"], "actor/updates_skipped": float(skipped),
                        "timing_s/update_inner": time.perf_counter() - t0})
        sp = self.model.config.sequence_parallel and ps.get_tensor_model_parallel_world_size() > 1
        for _, c in sorted(self.moe_load.counts.items()):  # tokens per expert of the whole sequence
            if sp:  # each TP rank routed its sequence-parallel slice
                dist.all_reduce(c, group=ps.get_tensor_model_parallel_group())
            self.cp.sum(c)
        metrics.update(self.moe_load.metrics())
        if self.mtp is not None:
            metrics.update(self.mtp_loss.take(ps.get_data_parallel_group() if dp > 1 else None))
            metrics.update(self.mtp.take(ps.get_data_parallel_group() if dp > 1 else None))
        if reasons:
            metrics["skip_reasons"] = reasons
        return metrics if self.reports else None

    def _divisor(self, gbi: dict) -> int:
        """What Megatron's per-token mode divides the gradients by: the loss functions' token counts summed
        over DP × CP, i.e. the mini-batch's response tokens once per CP rank."""
        return gbi["batch_num_tokens"] * self.cp.size

    def _train_step(self, batch: RolloutBatch, gbi: dict, num_micro: int):
        """Megatron's ``forward_step``: each micro-batch's loss function returns (verl's loss of the micro-batch
        · divisor / DP, its response tokens, its report); summed and divided by the divisor (the response
        tokens of every micro-batch on every DP × CP rank), the gradients are verl's loss averaged over DP
        as before, under any split."""
        dp = gbi["dp_size"]
        weight = self._divisor(gbi) / dp

        def forward_step(data_iter, model):
            mb: PackedMicroBatch = next(data_iter)
            with (self.mtp_loss.micro_batch(mb.lengths[:len(mb.rows)]) if self.mtp_loss is not None
                  else contextlib.nullcontext()):
                logp, ent = self._logprobs(model, mb, self.cfg.rollout.temperature)
            vpreds = self._values(model, mb) if self.value_head is not None else None
            tokens = torch.tensor(int(batch.response_mask[mb.rows].sum()) if mb.rows else 0, dtype=torch.int,
                                  device=training_device())

            def loss_func(_out):
                loss, metrics = self.loss(batch, mb.rows, logp, ent, vpreds, gbi, num_micro)
                return loss * weight, tokens, metrics

            return logp, loss_func

        return forward_step

    def _finite(self, reports: list[dict]) -> tuple[bool, str]:
        """All ranks agree whether this mini-batch's losses and gradients are finite."""
        bad_loss = any(not np.isfinite(v) for r in reports for k, (v, _) in r.items() if k.endswith("loss"))
        grads = [p.main_grad for p in self.ddp.parameters()
                 if p.requires_grad and getattr(p, "main_grad", None) is not None]
        bad_grad = bool(grads) and not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
        flag = torch.tensor([float(bad_loss), float(bad_grad)], device=training_device())
        if dist.get_world_size() > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if flag[0]:
            return False, "non-finite loss"
        if flag[1]:
            return False, "non-finite gradient"
        return True, ""

    # ------------------------------------------------------------------ colocation (rl.schedule.colocate)
    def offload_memory(self) -> dict:
        """Hand what only the passes need to host memory for the colocated engine's generation phase
        (``rl.train.offload``)."""
        return self.offloader.offload()

    def restore_memory(self) -> dict:
        return self.offloader.restore()

    # ------------------------------------------------------------------ weights, checkpoints
    def export_adapter(self, version: int, include_mtp: Optional[bool] = None):
        """The policy adapter as an HF PEFT payload (rank 0; None elsewhere), in memory, bf16 with
        ``trainer.bf16`` (the engines' dtype) else fp32; ``include_mtp``: with the
        MTP layer's adapter under ``model.layers.{num_hidden_layers}.*`` (for a draft-model engine);
        None: when it is trained (``actor.mtp_loss_scale > 0``), so the engines' draft head follows it."""
        if include_mtp is None:
            include_mtp = self.mtp is not None and self.cfg.actor.mtp_loss_scale > 0
        with synced_params(self.ddp, self.opt):
            state = gather_adapter(self.model, "default")
        if state is None:
            return None
        dtype = torch.bfloat16 if self.cfg.trainer.bf16 else None  # what the engines compute with
        return AdapterPayload(version, peft_files(state, self.glm5.num_hidden_layers, self.glm5.n_routed_experts,
                                                  base_model=self.cfg.model.hf_dir, include_mtp=include_mtp,
                                                  dtype=dtype))

    def save(self, root: str, step: int, trainer_state: dict, rollout_adapter=None) -> None:
        """``rollout_adapter``: the adapter payload an in-flight (one-step-off-policy) batch is being
        generated with, kept in rank 0's state so a resume regenerates that batch exactly."""
        extra = {"value_head": self.value_head.state_dict() if self.value_head is not None else None,
                 "rollout_adapter": rollout_adapter if dist.get_rank() == 0 else None}
        with synced_params(self.ddp, self.opt):
            save_run(root, step, self.model, self.opt, self.sched, trainer_state, adapters=self.lora_cfg,
                     save_base=False, hf_dir=self.cfg.model.hf_dir, keep_last=self.cfg.trainer.keep_last,
                     base_ckpt=self.cfg.model.ckpt, rank_extra=extra)

    @torch.no_grad()
    def restore(self, root: str) -> Optional[dict]:
        """Adapters, optimizer, scheduler, RNG and value head from ``root``'s latest iteration (an MTP
        block measured but not trained may have no saved adapter)."""
        if not (Path(root) / "latest").is_file():
            return None
        out, rs = restore_run(root, latest_iteration(root), self.model, self.opt, self.sched,
                              adapters=tuple(self.lora_cfg), optional_prefixes=("mtp.",))
        if self.value_head is not None:
            self.value_head.load_state_dict(rs["value_head"])
        if rs.get("rollout_adapter") is not None:
            out["rollout_adapter"] = rs["rollout_adapter"]
        return out

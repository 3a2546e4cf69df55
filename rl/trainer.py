"""One trainer rank: GLM-5 on Megatron-Core with the policy LoRA adapter (and, for GAE, the
critic: a value head + its own adapter "critic" on the same frozen base), the indexer frozen.

It runs in-process (tests) or inside a Ray actor (``rl.workers``); all ranks of a run form one
torch.distributed group (gloo on CPU, NCCL on GPU) with Megatron's TP/EP/DP groups. Sequences are
THD-packed (prompt + response per document) into micro-batches of ``actor.micro_batch_tokens``.

- ``compute_log_probs``: old log-probs (policy adapter), reference log-probs (adapters disabled —
  the same weights, no second model), critic values; forward only.
- ``update``: PPO epochs over mini-batches; per micro-batch verl's policy loss (rollout-correction
  weights multiplied in per token) + KL loss + entropy bonus + value loss, aggregated with verl's
  ``agg_loss`` over the *mini-batch's* global token / sequence counts; Megatron's schedule does the
  backward and DP reduction. A non-finite loss or gradient skips the optimizer step with a reason.
- ``export_adapter``: the policy adapter as an HF PEFT payload (the rollout engines' weight sync).
- Expert load (tokens per expert, max/mean per MoE layer) of each update is in its metrics.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from glm5_mcore.data.order import equal_micro_batch_sizes, greedy_packs
from glm5_mcore.device import training_device
from rl.algos import ActorLoss
from rl.batch import RolloutBatch
from rl.config import RLConfig


class ValueHead(torch.nn.Module):
    """V(s_t) = w · h_t + b on the final-norm hidden state [s, b, H] -> [s, b] (fp32, replicated)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, 1)
        torch.nn.init.zeros_(self.proj.weight)
        torch.nn.init.zeros_(self.proj.bias)

    def forward(self, h):
        return self.proj(h.float()).squeeze(-1)


class _Packed:
    """Micro-batch: samples ``rows`` packed THD; ``pos`` [n, R] logit positions of each response
    token (its predecessor's position) in the unsplit pack. With context parallelism (``cp``, an
    ``rl.cp.RLContextParallel`` of size > 1) the tensors hold this CP rank's share (``rl.cp``) and
    ``pad_to`` counts the padded documents' tokens."""

    def __init__(self, batch: RolloutBatch, rows: list[int], pad_to: int, pad_id: int, route_shape=None, cp=None):
        ids, targets, positions, lengths = [], [], [], []
        R = batch.response_mask.shape[1]
        self.rows = rows
        self.pos = torch.zeros(len(rows), R, dtype=torch.long)
        off = 0
        for j, i in enumerate(rows):
            seq = batch.prompts[i] + batch.responses[i]
            P, n = len(batch.prompts[i]), len(batch.responses[i])
            ids += seq
            targets += seq[1:] + [0]
            positions += list(range(len(seq)))
            lengths.append(len(seq))
            self.pos[j, :n] = torch.arange(off + P - 1, off + P - 1 + n)
            off += len(seq)
        self.real_tokens = off
        self.pad_id = pad_id
        used = cp.padded_len(lengths) if cp is not None else off
        if pad_to > used:  # filler document (masked out) so EP ranks see equal token counts
            extra = pad_to - used
            ids += [pad_id] * extra
            targets += [0] * extra
            positions += list(range(extra))
            lengths.append(extra)
        self.num_tokens = len(ids)
        self.real_mask = torch.arange(self.num_tokens) < off  # the documents (not filler or CP padding)
        self.input_ids = torch.tensor([ids])
        self.targets = torch.tensor(targets)
        self.position_ids = torch.tensor([positions])
        self.lengths = lengths
        self.routes = self.routes_valid = None  # R3: [T, L, k] engine experts in this THD order (rl.routing)
        if batch.routes is not None and route_shape:
            from rl.routing import pack_routes

            self.routes, self.routes_valid = pack_routes(batch.routes, batch.prompts, batch.responses, rows,
                                                         self.num_tokens, *route_shape)
        self.unsplit = None  # CP: see rl.cp
        if cp is not None:
            cp.split(self)

    def packed_seq_params(self, device=None):
        from glm5_mcore.model.build import packed_seq_params_from_lengths

        return packed_seq_params_from_lengths(self.lengths, device)


class PolicyTrainer:
    def __init__(self, cfg: RLConfig, rank: int = 0, world: int = 1, master_addr: Optional[str] = None,
                 master_port: Optional[int] = None):
        from glm5_mcore.config import ParallelConfig
        from glm5_mcore.model.dsa import check_indexer_learns
        from glm5_mcore.lora.apply import LoRAConfig, apply_lora, set_adapter
        from glm5_mcore.model.build import build_model, init_parallel, load_hf_weights
        from glm5_mcore.training.loop import MoELoad, OptimCfg, build_trainer
        from transformers import AutoTokenizer

        if master_addr is not None:
            os.environ.update(MASTER_ADDR=str(master_addr), MASTER_PORT=str(master_port), RANK=str(rank),
                              WORLD_SIZE=str(world), LOCAL_RANK=os.environ.get("LOCAL_RANK", "0"))
        self.cfg = cfg
        t = cfg.trainer
        self.parallel = ParallelConfig(tp=t.tp, ep=t.ep, cp=t.cp)
        from glm5_mcore.checkpoint.folder_config import run_model_config

        from rl.mtp import DraftAcceptance, mtp_layers

        self.glm5 = run_model_config(cfg.model.ckpt, cfg.model.hf_dir)  # checked before Ray too (rl.validate)
        # the MTP block: trained with actor.mtp_loss_scale > 0, measured only with actor.mtp_accept
        mtp = mtp_layers(cfg.actor.mtp_loss_scale, self.glm5, cfg.model.ckpt or cfg.model.hf_dir,
                         cfg.actor.mtp_accept)
        overrides_mtp = {"mtp_loss_scaling_factor": cfg.actor.mtp_loss_scale} if mtp else {}
        init_parallel(self.parallel, seed=t.seed)
        self.pad_id = AutoTokenizer.from_pretrained(cfg.model.hf_dir).pad_token_id or 0
        overrides = {"bf16": True, "params_dtype": torch.bfloat16} if t.bf16 else {}
        model = build_model(self.glm5, self.parallel, backend=t.backend, mtp_num_layers=mtp,
                            moe_enable_routing_replay=True, **overrides, **overrides_mtp)
        if cfg.model.ckpt:
            from glm5_mcore.checkpoint.layout import load_model, model_dir

            load_model(model, model_dir(cfg.model.ckpt))
        else:
            load_hf_weights(model, cfg.model.hf_dir, self.glm5)
        self.lora_cfg = {"default": LoRAConfig(rank=cfg.lora.rank, alpha=cfg.lora.alpha,
                                               targets=tuple(cfg.lora.targets), seed=t.seed)}
        apply_lora(model, self.lora_cfg["default"], "default", freeze_indexer=t.freeze_indexer)
        self.value_head = None
        if cfg.use_critic:
            c = cfg.critic.lora
            self.lora_cfg["critic"] = LoRAConfig(rank=c.rank, alpha=c.alpha, targets=tuple(c.targets),
                                                 seed=t.seed + 1)
            apply_lora(model, self.lora_cfg["critic"], "critic", freeze_indexer=t.freeze_indexer)
            model.value_head = self.value_head = ValueHead(self.glm5.hidden_size).to(training_device())
            self._hidden = None
            model.output_layer.register_forward_pre_hook(self._capture_hidden)
        set_adapter(model, "default")
        if mtp and not cfg.actor.mtp_loss_scale:
            from rl.mtp import freeze_mtp_adapters

            freeze_mtp_adapters(model)  # MTP block built to measure rollout/mtp_accept only
        check_indexer_learns(model, "trainer.freeze_indexer")
        from glm5_mcore.model.mtp_loss import fp32_output_layer

        fp32_output_layer(model)  # log-probs from fp32 logits under bf16 (old, ref, new: IcePop's ratios)
        self.model = model
        from rl.cp import RLContextParallel

        self.cp = RLContextParallel(self.parallel.tp if model.config.sequence_parallel else 1)
        from rl.routing import TrainerRouting

        self.routing = TrainerRouting(model, replay=cfg.algorithm.router_replay)
        self.mtp = DraftAcceptance(model) if mtp else None
        self.moe_load = MoELoad(model)
        a = cfg.actor
        self.ddp, self.opt, self.sched = build_trainer(model, OptimCfg(
            lr=a.lr, weight_decay=a.weight_decay, clip_grad=a.clip_grad, adam_beta1=a.adam_beta1,
            adam_beta2=a.adam_beta2, decay_style="constant"), t.steps, bf16=t.bf16)
        self.loss = ActorLoss(cfg)

    # ------------------------------------------------------------------ helpers
    def _capture_hidden(self, _mod, args):
        self._hidden = args[0]

    @property
    def reports(self) -> bool:
        """Whether this rank's results are the ones the driver reads (TP and CP rank 0)."""
        from megatron.core import parallel_state as ps

        return ps.get_tensor_model_parallel_rank() == 0 and ps.get_context_parallel_rank() == 0

    def _dp(self) -> tuple[int, int]:
        from megatron.core import parallel_state as ps

        return ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()

    def _micro_batches(self, batch: RolloutBatch, rows: list[int]) -> list[_Packed]:
        """Greedy THD packing of ``rows`` into micro-batches; with >1 rank every rank gets the same
        number of micro-batches of the same sizes (Megatron's allgather dispatcher needs equal EP shares)."""
        lengths = [len(batch.prompts[i]) + len(batch.responses[i]) for i in rows]
        packs = list(greedy_packs(lengths, self.cfg.actor.micro_batch_tokens))
        cp = self.cp if self.cp.size > 1 else None
        own = [cp.padded_len([lengths[j] for j in g]) if cp is not None else sum(lengths[j] for j in g)
               for g in packs]  # CP: documents padded for the split
        sizes = equal_micro_batch_sizes(own, fill=cp.unit if cp is not None else 1)
        groups = [[rows[j] for j in g] for g in packs] + [[] for _ in range(len(sizes) - len(packs))]
        mult = self.parallel.tp if self.model.config.sequence_parallel else 1
        shape = (len(self.routing.instances), self.routing.top_k)
        return [_Packed(batch, g, -(-n // mult) * mult, self.pad_id, shape, cp) for g, n in zip(groups, sizes)]

    def _logprobs(self, model, mb: _Packed, temperature: float):
        """(log p [n, R], entropy [n, R]) of each response token under ``model``'s active adapter."""
        from megatron.core import parallel_state as ps

        from glm5_mcore.model.mtp_loss import token_logprobs
        from rl.mtp import real_token_mask

        dev = training_device()
        self.routing.prepare(mb.routes, dev)
        self.moe_load.token_mask = self.routing._slice(mb.real_mask) if self.routing.routers else None
        kw = {"loss_mask": real_token_mask(mb.num_tokens, mb.real_tokens, dev)} if self.mtp is not None else {}
        logits = model(input_ids=mb.input_ids.to(dev), position_ids=mb.position_ids.to(dev), attention_mask=None,
                       packed_seq_params=mb.packed_seq_params(dev), **kw)[0]  # [T, V/TP]
        group = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
        logp, ent = token_logprobs(logits, mb.targets.to(dev), group, temperature)
        if mb.unsplit is not None:  # CP: every rank's tokens, in the unsplit order
            logp, ent = self.cp.gather(torch.stack([logp, ent], -1), mb).unbind(-1)
        pos = mb.pos.to(dev)
        return logp[pos], ent[pos]

    def _values(self, model, mb: _Packed) -> torch.Tensor:
        from glm5_mcore.lora.apply import set_adapter

        from rl.mtp import mtp_loss_off

        set_adapter(self.model, "critic")
        dev = training_device()
        self.routing.prepare(mb.routes, dev)
        self.moe_load.token_mask = self.routing._slice(mb.real_mask) if self.routing.routers else None
        try:
            with mtp_loss_off(self.model) if self.mtp is not None else contextlib.nullcontext():
                model(input_ids=mb.input_ids.to(dev), position_ids=mb.position_ids.to(dev), attention_mask=None,
                      packed_seq_params=mb.packed_seq_params(dev))
        finally:
            set_adapter(self.model, "default")
        h = self._hidden  # [T, 1, H]
        if self.model.config.sequence_parallel:
            from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

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
        from glm5_mcore.lora.apply import disable_adapters
        from rl.mtp import drafted_positions

        dp, dp_rank = self._dp()
        rows = list(range(batch.size))[dp_rank::dp]
        T = self.cfg.rollout.temperature
        self.ddp.eval()
        out = {"rows": [], "old_log_probs": [], "ref_log_probs": [], "values": []}
        from rl.routing import index_topk_counts

        agree, index_agree = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
        for mb in self._micro_batches(batch, rows):
            if self.mtp is not None:  # rollout/mtp_accept from the MTP logits this forward computes anyway
                self.mtp.arm(mb.input_ids.to(training_device()),
                             drafted_positions(mb.pos, [len(batch.responses[i]) for i in mb.rows]))
            old, _ = self._logprobs(self.ddp, mb, T)
            out["old_log_probs"].append(old)
            if mb.routes is not None:
                agree += self.routing.agreement(mb.routes, mb.routes_valid).cpu()
            if batch.index_topk is not None:
                index_agree += index_topk_counts(self.model, batch, mb.rows, mb if mb.unsplit is not None else None)
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
        from glm5_mcore.training.loop import forward_backward

        a = self.cfg.actor
        dp, dp_rank = self._dp()
        n = self.cfg.rollout.n
        n_prompts = batch.size // n
        sums: dict[str, float] = {}
        weights: dict[str, float] = {}
        skipped, reasons, grad_norms, n_micro = 0, [], [], 0
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
                micro = self._micro_batches(batch, mb_rows[dp_rank::dp])
                n_micro += len(micro)
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
        from megatron.core import parallel_state as ps

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
            from glm5_mcore.model.mtp_loss import mtp_depth_losses

            depth = mtp_depth_losses(self.glm5.num_nextn_predict_layers, n_micro)
            metrics["mtp/loss"] = float(np.mean([v for k, v in depth.items() if k.startswith("mtp_loss/")]))
            metrics.update(depth)
            metrics.update(self.mtp.take(ps.get_data_parallel_group() if dp > 1 else None))
        if reasons:
            metrics["skip_reasons"] = reasons
        return metrics if self.reports else None

    def _train_step(self, batch: RolloutBatch, gbi: dict, num_micro: int):
        def forward_step(data_iter, model):
            mb: _Packed = next(data_iter)
            logp, ent = self._logprobs(model, mb, self.cfg.rollout.temperature)
            vpreds = self._values(model, mb) if self.value_head is not None else None

            def loss_func(_out):
                loss, metrics = self.loss(batch, mb.rows, logp, ent, vpreds, gbi, num_micro)
                return loss * num_micro, metrics

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

    # ------------------------------------------------------------------ weights, checkpoints
    def export_adapter(self, version: int, include_mtp: Optional[bool] = None):
        """The policy adapter as an HF PEFT payload (rank 0; None elsewhere); ``include_mtp``: with the
        MTP layer's adapter under ``model.layers.{num_hidden_layers}.*`` (for a draft-model engine);
        None: when it is trained (``actor.mtp_loss_scale > 0``), so the engines' draft head follows it."""
        if include_mtp is None:
            include_mtp = self.mtp is not None and self.cfg.actor.mtp_loss_scale > 0
        from glm5_mcore.lora.state import gather_adapter
        from glm5_mcore.lora.peft import export_peft
        from rl.rollout.base import AdapterPayload

        state = gather_adapter(self.model, "default")
        if state is None:
            return None
        with tempfile.TemporaryDirectory() as d:
            out = export_peft(state, self.glm5.num_hidden_layers, self.glm5.n_routed_experts, Path(d) / "a",
                              base_model=self.cfg.model.hf_dir,
                              include_mtp=include_mtp)
            return AdapterPayload(version, {p.name: p.read_bytes() for p in out.iterdir()})

    def save(self, root: str, step: int, trainer_state: dict, rollout_adapter=None) -> None:
        """``rollout_adapter``: the adapter payload an in-flight (one-step-off-policy) batch is being
        generated with, kept in rank 0's state so a resume regenerates that batch exactly."""
        from glm5_mcore.checkpoint.layout import prune_iterations, save_checkpoint, write_hf_meta
        from glm5_mcore.training.loop import rng_state

        rank_state = {"scheduler": self.sched.state_dict(), "rng": rng_state(),
                      "value_head": self.value_head.state_dict() if self.value_head is not None else None,
                      "rollout_adapter": rollout_adapter if dist.get_rank() == 0 else None}
        save_checkpoint(root, step, self.model, trainer_state, adapters=self.lora_cfg, save_base=False,
                        rank_state=rank_state, optimizer=self.opt)
        if dist.get_rank() == 0:
            if not (Path(root) / "hf").is_dir():
                write_hf_meta(Path(root) / "hf", self.cfg.model.hf_dir)
            prune_iterations(root, self.cfg.trainer.keep_last)
        dist.barrier()

    @torch.no_grad()
    def restore(self, root: str) -> Optional[dict]:
        """Adapters, optimizer, scheduler, RNG and value head from ``root``'s latest iteration."""
        from glm5_mcore.lora.state import read_adapter_state
        from glm5_mcore.checkpoint.layout import (adapter_dir, iter_dir, latest_iteration, load_optimizer, load_rank_state,
                                           read_trainer_state)
        from glm5_mcore.lora.apply import lora_layers
        from glm5_mcore.training.loop import set_rng_state

        if not (Path(root) / "latest").is_file():
            return None
        it = latest_iteration(root)
        for name in self.lora_cfg:
            st = read_adapter_state(adapter_dir(root, name, it))
            for _, _, lora in lora_layers(self.model):
                if name in lora.A and (lora.module_name in st.A or not lora.module_name.startswith("mtp.")):
                    lora.load_full_(name, st.A[lora.module_name], st.B[lora.module_name])
        rs = load_rank_state(root, it, dist.get_rank())
        load_optimizer(self.opt, self.model, iter_dir(root, it) / "optimizer" / "dist")
        self.sched.load_state_dict(rs["scheduler"])
        set_rng_state(rs["rng"])
        if self.value_head is not None:
            self.value_head.load_state_dict(rs["value_head"])
        out = read_trainer_state(root, it)
        if rs.get("rollout_adapter") is not None:
            out["rollout_adapter"] = rs["rollout_adapter"]
        return out

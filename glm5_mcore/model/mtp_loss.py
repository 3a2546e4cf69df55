"""What training needs around Megatron-Core's MTP path and output layer.

- ``mtp_depth_losses``: the per-depth MTP loss (and acceptance rate) of the last step(s), read from
  Megatron-Core's ``MTPLossLoggingHelper`` tracker (filled by ``process_mtp_loss``, which applies
  the loss mask and rolls labels *within* each packed document, so no MTP target crosses a document
  boundary or lands on a prompt token), averaged over data-parallel ranks, then cleared.
- ``token_logprobs``: log-probability of given target tokens and the entropy of the main head's
  distribution, computed vocab-parallel (each TP rank holds V/TP logits; three all-reduces of
  [tokens] floats, never the full vocabulary) — what RL needs for π(token) and entropy.
- ``fp32_output_layer``: the output projection of a bf16 model computed in fp32, so log-probs
  (old / reference / new, and IcePop's ratios of them) carry no bf16 rounding of the logits.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def mtp_depth_losses(num_layers: int, microbatches: int = 1) -> dict[str, float]:
    """{"mtp_loss/depth_{k}": loss, "mtp_accept/depth_{k}": rate} for k = 1..num_layers; clears it."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    tracker = MTPLossLoggingHelper.tracker
    if not num_layers or "loss_values" not in tracker:
        return {}
    loss = tracker["loss_values"].clone().float()
    correct, total = tracker["correct_values"].clone().float(), tracker["total_values"].clone().float()
    group = tracker.get("avg_group")
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(loss, group=group)
        loss /= dist.get_world_size(group)
        dist.all_reduce(correct, group=group)
        dist.all_reduce(total, group=group)
    MTPLossLoggingHelper.clean_metrics_in_tracker()
    out = {}
    for k in range(num_layers):
        out[f"mtp_loss/depth_{k + 1}"] = float(loss[k]) / max(1, microbatches)
        out[f"mtp_accept/depth_{k + 1}"] = float(correct[k] / total[k].clamp(min=1))
    return out


class _VocabParallelLogProbEntropy(torch.autograd.Function):
    """log p(target) and entropy from vocab-sharded logits [..., V/TP] (fp32; -inf columns have p = 0)."""

    @staticmethod
    def forward(ctx, logits, target, vocab_start, group):
        logits = logits.float()
        lmax = logits.max(-1).values
        if group is not None:
            dist.all_reduce(lmax, op=dist.ReduceOp.MAX, group=group)
        # -inf logits (the vocabulary padding, ``model.vocab``) as the most negative float: exp still 0, and
        # the p·log p terms of the entropy and its gradient 0 instead of 0·(-inf) = NaN
        shifted = (logits - lmax[..., None]).clamp_min(torch.finfo(logits.dtype).min)
        exp = shifted.exp()
        sum_exp = exp.sum(-1)
        local = target - vocab_start
        in_range = (local >= 0) & (local < logits.shape[-1])
        tgt = torch.where(in_range, shifted.gather(-1, local.clamp(0, logits.shape[-1] - 1)[..., None])[..., 0],
                          torch.zeros_like(lmax))
        p_logit = (exp * shifted).sum(-1)
        if group is not None:
            packed = torch.stack([sum_exp, tgt, p_logit])
            dist.all_reduce(packed, group=group)
            sum_exp, tgt, p_logit = packed
        log_z = sum_exp.log()
        logp = tgt - log_z
        entropy = log_z - p_logit / sum_exp
        ctx.save_for_backward(shifted, log_z, entropy, local, in_range)
        return logp, entropy

    @staticmethod
    def backward(ctx, d_logp, d_ent):
        shifted, log_z, entropy, local, in_range = ctx.saved_tensors
        p = (shifted - log_z[..., None]).exp()
        logp_all = shifted - log_z[..., None]
        # d logp / d logits = onehot - p ;  d H / d logits = -p * (log p + H)
        grad = -p * d_logp[..., None] - p * (logp_all + entropy[..., None]) * d_ent[..., None]
        onehot = torch.zeros_like(p)
        onehot.scatter_(-1, local.clamp(0, p.shape[-1] - 1)[..., None], in_range[..., None].to(p.dtype))
        grad = grad + onehot * d_logp[..., None]
        return grad, None, None, None


def token_logprobs(logits: torch.Tensor, target: torch.Tensor, tp_group=None,
                   temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy) of ``log_softmax(logits / temperature)`` over the full vocabulary.

    ``logits`` [..., V/TP] is this rank's vocabulary shard (rank r holds ids [r·V/TP, (r+1)·V/TP));
    ``target`` [...] token ids. Differentiable in ``logits``."""
    size = dist.get_world_size(tp_group) if tp_group is not None and dist.is_initialized() else 1
    rank = dist.get_rank(tp_group) if size > 1 else 0
    vocab_start = rank * logits.shape[-1]
    if temperature != 1.0:
        logits = logits / temperature
    return _VocabParallelLogProbEntropy.apply(logits, target, vocab_start, tp_group if size > 1 else None)


def fp32_output_layer(model):
    """Make ``model``'s output layer (a Megatron ``ColumnParallelLinear``) compute in fp32: its input
    hidden states [s, b, H] and weight [V/TP, H] are upcast before the matmul, so the logits
    [s, b, V/TP] are fp32 products rather than bf16-rounded ones (an error of about |logit|·2⁻⁸ that
    would go straight into log-probs). A no-op for an fp32 model. Returns the hook handle.

    The upcast weight is a copy, so use it where the output layer is frozen (LoRA: RL's policy)."""
    layer = model.output_layer

    def upcast(mod, args, kwargs):
        w = kwargs.get("weight")
        w = mod.weight if w is None else w
        if args[0].dtype == torch.float32 and w.dtype == torch.float32:
            return None
        return (args[0].float(), *args[1:]), {**kwargs, "weight": w.float()}

    return layer.register_forward_pre_hook(upcast, with_kwargs=True)


def model_token_logprobs(model, input_ids, position_ids, targets, packed_seq_params=None,
                         temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of ``targets`` [b, s] and entropy under ``model`` (vocab-parallel at TP>1)."""
    from megatron.core import parallel_state as ps

    logits = model(input_ids=input_ids, position_ids=position_ids, attention_mask=None,
                   packed_seq_params=packed_seq_params)  # [b, s, V/TP]
    group: Optional[object] = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
    return token_logprobs(logits, targets, group, temperature)

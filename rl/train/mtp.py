"""MTP in RL: the draft head trains beside the policy, and its acceptance is measured every step.

GLM-5 is served with its MTP layer as the speculative-decoding draft. LoRA moves the hidden states
the MTP layer reads, so with ``actor.mtp_loss_scale > 0`` the trainer builds the MTP block and
Megatron-Core's own ``process_mtp_loss`` trains it on the rollout sequences (labels derived from
``input_ids``, rolled *within* each packed document; the main logits PPO reads are untouched).

- ``mtp_layers``: the MTP layers to build (None: none), or a ValueError naming why the loss cannot be
  on. With the loss off and ``actor.mtp_accept`` the stored block is built to measure acceptance only:
  how far the draft head falls behind the moving policy.
- ``freeze_mtp_adapters``: loss off — the MTP layer's adapters stay at their no-op init.
- ``real_token_mask``: [1, T] 1 on the documents of a packed micro-batch, 0 on its filler — the
  ``loss_mask`` of the MTP loss (Megatron rolls it twice: position i trains on token i+2 of its doc).
- ``DraftAcceptance``: ``rollout/mtp_accept`` — of the response tokens after the first, the fraction
  whose MTP draft (greedy argmax of the depth-1 MTP logits at position t-2, i.e. drafted from the
  previous position's verified token, as vLLM's MTP proposer does) equals the sampled token t. The
  logits are the ones the old-log-prob forward already computes (an output-layer hook), counted with
  Megatron's ``_compute_mtp_acceptance_counts`` (vocab-parallel argmax at TP > 1).
- ``PerTokenMTP``: the update's MTP loss in per-token form (Megatron's ``calculate_per_token_loss``, as SFT):
  λ · Σ CE over the mini-batch's MTP tokens / their count, whatever the micro-batch split, and ``mtp/loss``
  the same per-token mean.
- ``mtp_loss_off``: a forward that must not train the MTP head (the critic's) contributes no MTP
  gradient and leaves the loss tracker as it was.
- Weight sync: with the loss on, the adapter the trainer pushes carries the MTP layer's LoRA under
  ``model.layers.{num_hidden_layers}.*``. vLLM merges it into its draft model (``rl.rollout.vllm_engine``,
  merged and LoRARequest modes alike); an engine without an MTP module drops it
  (``rl.rollout.draft.adapter_without_mtp``: transformers' GLM-5 has none, so the HF engine never drafts).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist


def mtp_layers(scale: float, glm5, source: str, measure: bool = False) -> Optional[int]:
    """MTP layers to build (None: no MTP block). ``scale > 0``: those the folder stores, a folder storing
    none refused, naming why. ``scale = 0``: none, unless ``measure`` (``actor.mtp_accept``): then those
    stored, built to measure ``rollout/mtp_accept`` only (no MTP gradient, their adapters frozen)."""
    if scale < 0:
        raise ValueError(f"actor.mtp_loss_scale={scale} must be >= 0")
    if scale == 0:
        if measure and not glm5.num_nextn_predict_layers:
            raise ValueError(f"actor.mtp_accept=true: {source} stores no MTP layer weights, so there is no draft "
                             "head to measure; set actor.mtp_accept=false or use a folder with the MTP layer")
        return (glm5.num_nextn_predict_layers or None) if measure else None
    if not glm5.num_nextn_predict_layers:
        raise ValueError(f"actor.mtp_loss_scale={scale}: {source} stores no MTP layer weights (a transformers "
                         "save_pretrained folder, or num_nextn_predict_layers=0), so there is no draft head to "
                         "train; set actor.mtp_loss_scale=0 or use a folder with the MTP layer")
    return glm5.num_nextn_predict_layers


def freeze_mtp_adapters(model) -> None:
    """No gradient (hence no optimizer state) for the MTP layer's adapter parameters."""
    for n, p in model.named_parameters():
        if n.startswith("mtp.") and ".lora." in n:
            p.requires_grad_(False)


def real_token_mask(num_tokens: int, real_tokens: int, device=None) -> torch.Tensor:
    """[1, T] float: 1 on the first ``real_tokens`` (the packed documents), 0 on the filler."""
    m = torch.zeros(1, num_tokens, device=device)
    m[0, :real_tokens] = 1.0
    return m


def drafted_positions(pos: torch.Tensor, n_resp: list[int]) -> torch.Tensor:
    """Packed positions t of the response tokens after the first ([k] long); ``pos`` [n, R] holds
    each response token's predecessor position (so token k of row j sits at ``pos[j, k] + 1``)."""
    return torch.cat([pos[j, 1:n] + 1 for j, n in enumerate(n_resp)] or [torch.zeros(0, dtype=torch.long)])


class DraftAcceptance:
    """Counts MTP drafts that equal the sampled tokens, from the depth-1 MTP logits of an armed forward.

    ``process_mtp_loss`` runs the output layer on each MTP depth's hidden states before the main
    ones, so the first output-layer call after ``arm`` is depth 1: logits [T, 1, V/TP]."""

    def __init__(self, model):
        self.model = model
        self._armed: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        self.correct = 0.0
        self.total = 0.0
        model.output_layer.register_forward_hook(self._hook)

    def arm(self, input_ids: torch.Tensor, drafted: torch.Tensor) -> None:
        """Next forward's depth-1 MTP logits at t-2 are compared with ``input_ids`` [1, T] at each
        drafted position t."""
        T = input_ids.shape[1]
        labels = torch.zeros_like(input_ids)
        mask = torch.zeros(1, T, device=input_ids.device)
        src = drafted[drafted >= 2].to(input_ids.device)
        labels[0, src - 2] = input_ids[0, src]
        mask[0, src - 2] = 1.0
        self._armed = (labels, mask)

    def _hook(self, mod, _inp, out):
        if self._armed is None:
            return
        from megatron.core import parallel_state as ps
        from megatron.core.transformer.multi_token_prediction import _compute_mtp_acceptance_counts

        labels, mask = self._armed
        self._armed = None
        tp = ps.get_tensor_model_parallel_group() if ps.get_tensor_model_parallel_world_size() > 1 else None
        c, t = _compute_mtp_acceptance_counts(out[0], labels, mask, mod, None, tp)
        self.correct += float(c)
        self.total += float(t)

    def take(self, dp_group=None) -> dict[str, float]:
        """{"rollout/mtp_accept": rate over this step's batch (summed over DP ranks)}; resets."""
        from glm5_mcore.device import training_device

        t = torch.tensor([self.correct, self.total], dtype=torch.float64, device=training_device())
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(t, group=dp_group)
        self.correct = self.total = 0.0
        return {"rollout/mtp_accept": float(t[0] / t[1]) if t[1] > 0 else float("nan")}


def mtp_tokens(lengths: list[int], depth: int) -> int:
    """MTP tokens of documents of ``lengths`` at ``depth`` (1 = the first MTP layer): Megatron's
    ``process_mtp_loss`` rolls the labels (and the loss mask) once to derive them from ``input_ids`` and once
    more per depth, each roll within a packed document dropping its last position; depth 0 is the count
    after the first roll (its ``original_num_tokens``)."""
    return sum(max(n - 1 - depth, 0) for n in lengths)


class PerTokenMTP:
    """The RL update's MTP loss per token: λ/D · Σ_d Σ CE_d / N_d over the mini-batch (every DP rank's
    micro-batches), N_d its MTP tokens at depth d, λ = ``actor.mtp_loss_scale``, D the MTP depths.

    The trainer runs Megatron's per-token mode (``calculate_per_token_loss``): ``finalize_model_grads``
    divides every gradient by the step's token count ``divisor`` (the loss functions' counts, summed over
    DP), and ``process_mtp_loss`` adds each micro-batch's λ/D · Σ CE_d · N'/N_d (N' its depth-0 count: the
    ratio re-weights Megatron's per-micro-batch mean by the main loss's tokens,
    multi_token_prediction.py:876-886). That ratio changes with the split, so ``micro_batch`` sets this
    micro-batch's ``mtp_loss_scaling_factor`` to λ · divisor · N_1 / (N' · N_1 of the mini-batch): the sum
    over micro-batches is then the per-token form at depth 1 exactly (GLM-5 has one MTP layer; deeper
    depths keep depth 1's weights). ``take``: ``mtp_loss/depth_k`` per token (Megatron's tracker holds each
    micro-batch's mean, weighted back by its N_d), averaged over mini-batches, and ``mtp/loss``."""

    def __init__(self, model, scale: float, depths: int):
        self.config, self.scale, self.depths = model.config, scale, depths
        self._step: list[int] = []
        self._divisor = 1.0
        self._sums: Optional[torch.Tensor] = None  # [D] Σ_mini-batches (Σ_micro mean_d · N_d) / N_d of the mini-batch
        self._mini = 0
        self._mini_sum: Optional[torch.Tensor] = None

    def mini_batch(self, lengths: list[int], divisor: float) -> None:
        """A mini-batch starts: ``lengths`` every sample's packed length (all DP ranks), ``divisor`` the
        per-token divisor Megatron will apply."""
        self._flush()
        self._step = [mtp_tokens(lengths, d) for d in range(1, self.depths + 1)]
        self._divisor = float(divisor)

    @contextlib.contextmanager
    def micro_batch(self, lengths: list[int]):
        """Around one micro-batch's training forward (its real documents' ``lengths``)."""
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        n0, n1 = mtp_tokens(lengths, 0), mtp_tokens(lengths, 1)
        self.config.mtp_loss_scaling_factor = (self.scale * self._divisor * n1 / max(n0, 1) / max(self._step[0], 1)
                                               if n1 else 0.0)
        before = MTPLossLoggingHelper.tracker.get("loss_values")
        before = before.clone() if before is not None else None
        try:
            yield
        finally:
            self.config.mtp_loss_scaling_factor = self.scale
        after = MTPLossLoggingHelper.tracker.get("loss_values")
        if after is None:
            return
        mean = after - before if before is not None else after.clone()
        counts = torch.tensor([mtp_tokens(lengths, d) for d in range(1, self.depths + 1)], dtype=mean.dtype,
                              device=mean.device)
        step = torch.tensor(self._step, dtype=mean.dtype, device=mean.device).clamp(min=1)
        part = mean * counts / step
        self._mini_sum = part if self._mini_sum is None else self._mini_sum + part

    def _flush(self) -> None:
        if self._mini_sum is not None:
            self._sums = self._mini_sum if self._sums is None else self._sums + self._mini_sum
            self._mini += 1
            self._mini_sum = None

    def take(self, dp_group=None) -> dict[str, float]:
        """{"mtp_loss/depth_k", "mtp_accept/depth_k", "mtp/loss"} of the update (summed over DP ranks); resets
        (Megatron's tracker too)."""
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        self._flush()
        tracker = MTPLossLoggingHelper.tracker
        if self._sums is None or "correct_values" not in tracker:
            return {}
        loss = self._sums.clone()
        correct, total = tracker["correct_values"].clone().float(), tracker["total_values"].clone().float()
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            for t in (loss, correct, total):
                dist.all_reduce(t, group=dp_group)
        MTPLossLoggingHelper.clean_metrics_in_tracker()
        out = {}
        for k in range(self.depths):
            out[f"mtp_loss/depth_{k + 1}"] = float(loss[k]) / self._mini
            out[f"mtp_accept/depth_{k + 1}"] = float(correct[k] / total[k].clamp(min=1))
        out["mtp/loss"] = sum(out[f"mtp_loss/depth_{k + 1}"] for k in range(self.depths)) / self.depths
        self._sums, self._mini = None, 0
        return out


@contextlib.contextmanager
def mtp_loss_off(model):
    """Within: the MTP loss adds no gradient (scale 0) and is not logged in the tracker."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    cfg = model.config
    scale = cfg.mtp_loss_scaling_factor
    saved = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in MTPLossLoggingHelper.tracker.items()}
    cfg.mtp_loss_scaling_factor = 0.0
    try:
        yield
    finally:
        cfg.mtp_loss_scaling_factor = scale
        MTPLossLoggingHelper.tracker.clear()
        MTPLossLoggingHelper.tracker.update(saved)

"""Activation memory of one rank for one micro-batch of ``tokens`` tokens: a formula.

Counted, per decoder layer, are the tensors autograd keeps for the backward pass (dtype ``b`` bytes;
s = tokens / CP on this rank, s' = s / TP under sequence parallelism, h = heads / TP,
r = s' · top-k · ETP tokens routed to this rank's experts on average):

    attention  s'·H (norm input) + s·H (gathered input of the replicated down projections)
               + 2·s·q_lora + s·(2·kv_lora + rope)          latents and their norms
               + s·h·qk_head + s·h·v                        q (rope applied), the core's output (proj input)
               + DSA core (``core_attention_bytes``): the absorbed sparse core, as the code saves it
               + 8·s·topk bytes                              selected key indices (int64; the fused path's int32: 4·s·topk)
    MoE        2·s'·H + 4·3·s'·E bytes (router logits, scores, probs, fp32)
               + r·(2·H + 3·M/ETP) + 4·r bytes               permuted tokens, fc1, act, fc2 out, probs
               + s·H + 3·s·S/TP                              shared expert
    dense MLP  s·H + 3·s·I/TP
    last stage s·H + 2·4·s·V/TP bytes (logits, their softmax in the loss) per output head (+ MTP)

With full recompute (Megatron's ``recompute_granularity="full"``, uniform, one layer per chunk) a
layer keeps only its input (s'·H), and one layer's full set lives again while it is recomputed;
a full DSA layer that IndexShare layers on the stage read keeps its top-k (``last_topk``, the
selected-indices bytes above) through the forward and backward, for their recompute (``topk_held``).
No other layer holds its top-k past its own backward (``GLM5SparseAttention.last_topk``).
With selective recompute (``"selective"``, ``recompute_modules=["core_attn"]``) a layer drops the core
attention's internals (``core_attention_bytes``: the core's inputs and output stay, being saved by the
projections around it), and one layer's core lives again while it is recomputed.
Transient, one layer at a time: the DSA indexer's scores of this rank's queries against every key
of the sequence (4·s·T bytes, fp32), chunked by query rows within ``CHUNK_BYTES`` (fused and
PyTorch paths alike); the DSA core's backward (``dsa_backward_transient``: the query and latent
gradients, the fp32 latent-row accumulator and, on the PyTorch path, one query chunk within
``CHUNK_BYTES``), the larger of the two and one DSA layer's peak (``dsa_core_peak``); and the MoE
dispatch buffers (send + receive, 2·r·H). Under
1F1B, stage ``i`` of ``pp`` holds ``min(pp - i, micro-batches)`` micro-batches in flight.

The DSA core's lines depend on the indexer's training stage (``DSA_STAGES``, the job's ``dsa_stage``): frozen
(above), the sparse KL (``sparse_loss``: the indexer's outputs and the fp32 target [s, K] kept per full
layer, ``indexer_training_bytes``; its gradients at the core's backward, ``sparse_loss_peak``) or the dense
warm-up (``warmup``: SDPA's saved tensors and, packed (THD) as SFT and RL run, its b·s·T bias of the
[s, T] mask per layer; the dense KL's chunks, ``warmup_kept`` / ``warmup_peak``).

Checked against a measured forward+backward (``tests/plan/test_plan.py::test_activation_formula_*``, the
PyTorch path at scaled-down widths) and one DSA layer's peak at full width, 32K and 128K tokens, in every
stage and at CP 2, on meta tensors (``tests/model/test_dsa_peak.py``, ``bench/dsa_peak.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from glm5_mcore.config import GLM5Config
from glm5_mcore.model.indexer_loss import dense_kl_row_bytes
from glm5_mcore.model.sparse_attention import CHUNK_BYTES, chunk_rows, latent_backward_row_bytes
from glm5_mcore.plan.layout import Layout

SPARSE_MLA_MIN_HEADS = 16  # TileLang's SparseMLA pads fewer query heads to 16 (ops/tilelang_dsa.py:788-794)
DSA_STAGES = ("sparse", "sparse_loss", "warmup")
"""The indexer's training stages: frozen (``sparse``), learning from the sparse KL (``sparse_loss``:
``train.freeze_indexer=false``), the dense warm-up (``warmup``: ``train.indexer_warmup=true``)."""


@dataclass
class ActivationBytes:
    saved_per_microbatch: int
    """Kept for backward by one micro-batch on this stage."""
    in_flight: int
    indexer_scores: int
    dispatch: int
    recompute_layer: int
    """One layer's full activations, alive while it is recomputed (0 without recompute)."""
    held_topk: int = 0
    """Under full recompute: the top-k IndexShare sources hold for their sharers (one micro-batch's)."""
    dsa_backward: int = 0
    """One DSA layer's backward transients above what it keeps (``dsa_backward_transient``)."""

    @property
    def peak(self) -> int:
        return (self.saved_per_microbatch * self.in_flight + self.recompute_layer + self.held_topk
                + max(self.indexer_scores, self.dsa_backward, self.dispatch))


def core_attention_bytes(m: GLM5Config, L: Layout, tokens: int, b: int, fused: bool = True) -> int:
    """What one DSA layer's absorbed sparse core (``sparse_attention.latent_attention``) keeps for backward
    besides its inputs (q, the latent, the int64 top-k) and its output, with D = kv_lora + rope (selective
    recompute drops exactly this):

        s·h'·(b·D + b·kv_lora + 4)   the absorbed query, the attention-weighted latent, the fp32 log-sum-exp
        + b·T·D                      the latent rows of the whole (CP-gathered) sequence

    h' = local heads, padded to 16 on the fused path (plus the unpadded b·s·h·kv_lora output copy then).
    Measured with ``saved_tensors_hooks`` in bf16: tests/model/test_dsa_cuda_path.py."""
    s = tokens // L.cp
    h = m.num_attention_heads // L.tp
    D, dc = m.kv_lora_rank + m.qk_rope_head_dim, m.kv_lora_rank
    hk = max(h, SPARSE_MLA_MIN_HEADS) if fused else h
    out = s * hk * (b * D + b * dc + 4) + b * tokens * D
    if fused and hk != h:
        out += b * s * h * dc
    return out


def indexer_transient(m: GLM5Config, L: Layout, tokens: int) -> int:
    """The indexer's scoring of this rank's queries against every key, at most ``CHUNK_BYTES`` per chunk."""
    return min(4 * (tokens // L.cp) * tokens, CHUNK_BYTES)


def dsa_backward_transient(m: GLM5Config, L: Layout, tokens: int, b: int, fused: bool = True) -> int:
    """What one DSA layer's absorbed core makes in its backward on top of what it keeps, D = kv_lora + rope:

        b·s·h'·D + b·s·h·kv_lora     the absorbed query's gradient, the attention-weighted latent's (W_uv's)
        + 4·T·D                      the fp32 accumulator of the latent rows' gradient (all of the sequence)
        + rows·row bytes             PyTorch path: one query chunk within ``CHUNK_BYTES``
                                     (``SparseLatentAttention.backward``, ``latent_backward_row_bytes``)
        or + 2·T·D + 4·s·h'          fused path: TileLang's bf16 copy of that gradient and its fp32 delta
                                     (tilelang_sparse_mla_bwd.py:518-523, by reading; its chunks stay on chip)

    h' = local heads, padded to 16 on the fused path. Measured (PyTorch path, meta tensors at full width,
    32K and 128K tokens): tests/model/test_dsa_peak.py."""
    s = tokens // L.cp
    h = m.num_attention_heads // L.tp
    D, dc = m.kv_lora_rank + m.qk_rope_head_dim, m.kv_lora_rank
    hk = max(h, SPARSE_MLA_MIN_HEADS) if fused else h
    out = b * s * hk * D + b * s * h * dc + 4 * tokens * D
    if fused:
        return out + 2 * tokens * D + 4 * s * hk
    row = latent_backward_row_bytes(min(m.index_topk, tokens), D, dc, h)
    return out + min(s, chunk_rows(row)) * row  # one sequence per micro-batch (THD)


def dsa_core_peak(m: GLM5Config, L: Layout, tokens: int, b: int, fused: bool = True, stage: str = "sparse",
                  masked: bool = True, workspace: bool = True) -> int:
    """Peak bytes one DSA layer's core holds above its inputs over its forward and backward, in training
    stage ``stage`` (``DSA_STAGES``). ``sparse``: what it keeps (``core_attention_bytes``, ``topk_bytes``),
    its output b·s·h·v (the output projection's saved input, counted in the attention line) and its
    backward's transients (``dsa_backward_transient``; the forward's, the indexer's chunk and the sparse
    core's, are smaller). ``sparse_loss`` and ``warmup``: ``sparse_loss_peak``, ``warmup_peak``
    (``masked``: the warm-up's dense attention takes an [s, T] mask, as under THD packing or CP;
    ``workspace``: with the attention kernel's own workspace, by reading)."""
    if stage == "sparse_loss":
        return sparse_loss_peak(m, L, tokens, b, fused)
    if stage == "warmup":
        return warmup_peak(m, L, tokens, b, masked, workspace)
    return dsa_core_kept(m, L, tokens, b, fused) + dsa_backward_transient(m, L, tokens, b, fused)


def dsa_core_kept(m: GLM5Config, L: Layout, tokens: int, b: int, fused: bool = True, stage: str = "sparse",
                  masked: bool = True) -> int:
    """What one DSA layer's core keeps from its forward to its backward above its inputs, its output
    b·s·h·v included, in training stage ``stage``: ``sparse`` the absorbed core's saved tensors and the
    top-k; ``sparse_loss`` those, the trainable indexer's (``indexer_training_bytes``) and the fp32
    target [s, K]; ``warmup`` ``warmup_kept``."""
    s = tokens // L.cp
    h = m.num_attention_heads // L.tp
    if stage == "warmup":
        return warmup_kept(m, L, tokens, b, masked)
    keep = core_attention_bytes(m, L, tokens, b, fused) + topk_bytes(m, L, tokens, fused) + b * s * h * m.v_head_dim
    if stage == "sparse_loss":
        keep += indexer_training_bytes(m, L, tokens, b) + 4 * s * min(m.index_topk, tokens)
    return keep


def indexer_training_bytes(m: GLM5Config, L: Layout, tokens: int, b: int) -> int:
    """What a trainable indexer (sparse-loss stage, warm-up) keeps for its KL's backward and its own:

        b·s·nI·(dI + 1) + b·T·dI      its query, head weights and (CP-gathered) key, the KL's saved inputs
        + s·(b·dI + 4·b·dr + 4·dr)    its own: wk's output (k_norm's input), the cos/sin of its q and k
                                      RoPE (bf16) and their fp32 angles
    (measured, meta tensors at full width: tests/model/test_dsa_peak.py)."""
    s = tokens // L.cp
    nI, dI = m.index_n_heads, m.index_head_dim
    return b * s * nI * (dI + 1) + b * tokens * dI + _indexer_own(m, s, b)


def _indexer_own(m: GLM5Config, s: int, b: int) -> int:
    dI, dr = m.index_head_dim, m.qk_rope_head_dim
    return s * (b * dI + 4 * b * dr + 4 * dr)


def sparse_loss_peak(m: GLM5Config, L: Layout, tokens: int, b: int, fused: bool = True) -> int:
    """One DSA layer's peak in the sparse-loss stage: the sparse stage's (its core's backward), with the
    indexer's output gradients waiting there for the indexer's own backward (b·s·nI·(dI + 1) + b·T·dI)
    and the indexer's own saved activations; the KL's inputs and target are freed by then (its backward
    runs first and its chunks, ``CHUNK_BYTES``, are below the core's). The fused path's line adds the same
    to the fused sparse line (by reading, not measured)."""
    s = tokens // L.cp
    nI, dI = m.index_n_heads, m.index_head_dim
    grads = b * s * nI * (dI + 1) + b * tokens * dI
    return dsa_core_peak(m, L, tokens, b, fused) + grads + _indexer_own(m, s, b)


def warmup_kept(m: GLM5Config, L: Layout, tokens: int, b: int, masked: bool = True) -> int:
    """What one DSA layer keeps above the core's inputs in the indexer warm-up (dense attention, PyTorch's
    SDPA, and the dense KL, ``DenseIndexerKL``, on every backend):

        b·s·h·v + 4·s·h               the attention's output and fp32 log-sum-exp
        + b·T·h·(qk + v)  (CP > 1)    the gathered per-head keys and values SDPA saves
        + b·s·T           (masked)    the additive bias SDPA makes from a boolean [s, T] mask (THD, CP)
        + ``indexer_training_bytes``

    Without CP the per-head keys and values SDPA saves are the core's inputs (``layer_bytes`` counts them)."""
    s = tokens // L.cp
    h = m.num_attention_heads // L.tp
    out = b * s * h * m.v_head_dim + 4 * s * h + indexer_training_bytes(m, L, tokens, b)
    if L.cp > 1:
        out += b * tokens * h * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
    if masked:
        out += b * s * tokens
    return out


def warmup_peak(m: GLM5Config, L: Layout, tokens: int, b: int, masked: bool = True, workspace: bool = True) -> int:
    """One DSA layer's peak in the indexer warm-up: the larger of

    - the dense KL's backward: what the layer keeps (``warmup_kept``), the indexer's gradients
      (b·s·nI·(dI + 1), fp32 key gradient and key 8·T·dI), the fp32 MLA keys the target is scored on
      (4·T·h·qk) and one query chunk (rows × ``dense_kl_row_bytes`` within ``CHUNK_BYTES``);
    - the attention's backward: what it keeps, the q/k/v gradients and (``workspace``) flash attention's
      fp32 dq accumulator and softmax row sums (4·s·h·(qk + 1); by reading, PyTorch's flash_api.cpp
      mha_bwd: a kernel's own buffers are not seen on meta tensors);
    - masked: the forward's boolean mask, its negation and the bias ((2 + b)·s·T)."""
    s = tokens // L.cp
    h = m.num_attention_heads // L.tp
    nI, dI = m.index_n_heads, m.index_head_dim
    qk, dv = m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim
    kept = warmup_kept(m, L, tokens, b, masked)
    row = dense_kl_row_bytes(tokens, h, nI)
    kl = kept + b * s * nI * (dI + 1) + 8 * tokens * dI + 4 * tokens * h * qk + min(s, chunk_rows(row)) * row
    attn = kept + b * h * (s * qk + tokens * (qk + dv)) + (4 * s * h * (qk + 1) if workspace else 0)
    return max(kl, attn, (2 + b) * s * tokens if masked else 0)


def dsa_stage_transient(m: GLM5Config, L: Layout, tokens: int, b: int, fused: bool = True, stage: str = "sparse") -> int:
    """What one DSA layer's core makes on top of what it keeps, at its peak, in ``stage``: ``dsa_core_peak``
    less ``dsa_core_kept`` (the sparse stage: ``dsa_backward_transient``). 0 where K ≥ T outside the warm-up
    (the core attends densely there)."""
    if stage != "warmup" and m.index_topk >= tokens:
        return 0
    return dsa_core_peak(m, L, tokens, b, fused, stage) - dsa_core_kept(m, L, tokens, b, fused, stage)


def topk_bytes(m: GLM5Config, L: Layout, tokens: int, fused_dsa: bool = True) -> int:
    """One DSA layer's selected key indices [s, K]: int64, the fused path's int32."""
    return (4 if fused_dsa else 8) * (tokens // L.cp) * min(m.index_topk, tokens)


def topk_held(m: GLM5Config, layers) -> int:
    """How many of ``layers`` (one stage's, in order) are full DSA layers read by a later IndexShare
    ("shared") layer of the same stage (``link_index_share``): each holds its top-k for them."""
    layers = list(layers)
    return sum(1 for a, b in zip(layers, layers[1:])
               if m.indexer_types[a] == "full" and m.indexer_types[b] == "shared")


def layer_bytes(m: GLM5Config, L: Layout, tokens: int, moe: bool, b: int, fused_dsa: bool = True,
                dsa_stage: str = "sparse") -> tuple[int, int]:
    """(attention + MLP bytes saved for backward by one layer, MoE routed tokens r) for ``tokens``, the
    DSA core's as it keeps them in ``dsa_stage`` (``dsa_stage_kept``)."""
    s = tokens // L.cp
    s_sp = s // L.tp if L.tp > 1 else s
    h = m.num_attention_heads // L.tp
    H = m.hidden_size
    att = b * (s_sp * H + s * H + 2 * s * m.q_lora_rank + s * (2 * m.kv_lora_rank + m.qk_rope_head_dim)
               + s * h * m.qk_head_dim + s * h * m.v_head_dim)
    att += dsa_stage_kept(m, L, tokens, b, fused_dsa, dsa_stage)
    if not moe:
        return att + b * (s * H + 3 * s * (m.intermediate_size // L.tp)), 0
    r = s_sp * m.num_experts_per_tok * L.etp
    mlp = b * 2 * s_sp * H + 4 * 3 * s_sp * m.n_routed_experts
    mlp += b * r * (2 * H + 3 * (m.moe_intermediate_size // L.etp)) + 4 * r
    if m.n_shared_experts:
        mlp += b * (s * H + 3 * s * (m.shared_expert_intermediate_size // L.tp))
    return att + mlp, r


def dsa_stage_kept(m: GLM5Config, L: Layout, tokens: int, b: int, fused: bool = True, stage: str = "sparse") -> int:
    """The DSA core's part of ``layer_bytes`` in ``stage``: ``dsa_core_kept`` without the core's output (the
    attention line's) and, in the warm-up without CP, with the per-head keys and values SDPA saves (the
    core's inputs there, b·s·h·(qk + v)). Packed (THD) batches, as SFT and RL make: the warm-up's mask."""
    s = tokens // L.cp
    h = m.num_attention_heads // L.tp
    out = dsa_core_kept(m, L, tokens, b, fused, stage) - b * s * h * m.v_head_dim
    if stage == "warmup" and L.cp == 1:
        out += b * s * h * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
    return out


def stage_activations(m: GLM5Config, L: Layout, stage: int, tokens: int, *, bf16: bool, recompute,
                      mtp: bool, microbatches: int, fused_dsa: bool = True, dsa_stage: str = "sparse") -> ActivationBytes:
    """``recompute``: False / None, ``"selective"``, or True / ``"full"`` (``glm5_mcore.mcore_settings.recompute_overrides``);
    ``dsa_stage``: the indexer's training stage (``DSA_STAGES``)."""
    if dsa_stage not in DSA_STAGES:
        raise ValueError(f"dsa_stage={dsa_stage!r}: one of {', '.join(DSA_STAGES)}")
    b = 2 if bf16 else 4
    selective = recompute == "selective"
    recompute = recompute in (True, "full")
    s = tokens // L.cp
    s_sp = s // L.tp if L.tp > 1 else s
    H = m.hidden_size
    layers = list(L.stage_layers(m, stage))
    last = stage == L.pp - 1
    n_mtp = m.num_nextn_predict_layers if (mtp and last) else 0
    per_layer = [layer_bytes(m, L, tokens, m.mlp_layer_types[i] == "sparse", b, fused_dsa,
                             dsa_stage if m.indexer_types[i] == "full" else "sparse") for i in layers]
    per_layer += [layer_bytes(m, L, tokens, True, b, fused_dsa, dsa_stage) for _ in range(n_mtp)]
    full = sum(x for x, _ in per_layer)
    biggest = max((x for x, _ in per_layer), default=0)
    r = max((y for _, y in per_layer), default=0)
    core = core_attention_bytes(m, L, tokens, b, fused_dsa) if selective else 0
    saved = len(per_layer) * b * s_sp * H if recompute else full - len(per_layer) * core
    if stage == 0:
        saved += b * s_sp * H
    if last:
        heads = 1 + n_mtp
        saved += heads * (b * s * H + 2 * 4 * s * L.vocab_rows(m))
        saved += n_mtp * b * s * 3 * H  # MTP: enorm/hnorm outputs and the eh_proj input [s, 2H]
    has_indexer = any(m.indexer_types[i] == "full" for i in layers) or n_mtp > 0
    return ActivationBytes(
        saved_per_microbatch=saved,
        in_flight=max(1, min(L.pp - stage, microbatches)),
        indexer_scores=indexer_transient(m, L, tokens) if has_indexer else 0,
        dsa_backward=dsa_stage_transient(m, L, tokens, b, fused_dsa, dsa_stage),
        dispatch=2 * b * r * H,
        recompute_layer=biggest if recompute else core,
        # without recompute the held top-k is the one the source layer saves for backward (counted)
        held_topk=topk_held(m, layers) * topk_bytes(m, L, tokens, fused_dsa) if recompute else 0,
    )

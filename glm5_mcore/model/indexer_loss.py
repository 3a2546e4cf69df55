"""DSA's sparse-stage indexer loss on the selected keys only, and the top-k recall metric.

Megatron-Core's ``compute_dsa_indexer_loss(..., sparse_loss=True)`` (transformer/
experimental_attention_variant/dsa.py) masks full [b, n, S, T] attention scores and [b, S, T]
indexer scores down to each query's top-k keys: per query, the main attention softmax over the
selected keys, summed over heads (all-reduced over TP) and L1-normalised, is the target of a KL
against the softmax of the indexer's scores over the same keys. Every term outside the selected
set is zero, so the same function is computed here on the gathered [S, K] form, O(S·K) memory:

- ``compute_sparse_attention_target`` (per-head query/key) or ``..._latent`` (the absorbed MLA query and
  shared latent the sparse core scores): the target, [b, S, K], computed without grad.
- ``SparseIndexerKL``: Σ_rows KL(target || softmax(I_sel)) where I[s, j] = Σ_h w[s,h]·ReLU(q[s,h]·k[idx[s,j]]),
  differentiable w.r.t. the indexer's q, w, k; backward recomputes per query chunk (nothing [S, K, nI]
  is kept). Megatron-Core's helpers reduce it (``dsa_indexer_loss.reduce_indexer_kl_sum``).
- ``DenseIndexerKL``: the warm-up's dense KL over every allowed key, chunked by query rows (never [S, T]).
- ``compute_topk_recall``: the dense attention mass (summed over heads, over every allowed key) that
  falls inside the top-k set, on a strided sample of at most ``max_rows`` query rows.

On CPU fp32 tensors the absorbed target and ``SparseIndexerKL`` run the fused kernels
(``glm5_mcore.kernels``: the selected rows read in place, no gathered copy); elsewhere query chunks within
``CHUNK_BYTES``, each chunk's temporaries freed before the next chunk's are made, and the gradients of
q and w written in their own dtype (no full-size fp32 copy).

Legend: S query rows, T key rows, b batch, n heads (local to a TP rank), h head dim, nI/dI indexer
heads/dim, K top-k, C query-chunk rows, R = b·S rows flattened.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.experimental_attention_variant import dsa_indexer_loss

from glm5_mcore import kernels
from glm5_mcore.model.sparse_attention import chunk_rows, deterministic_topk, flat_topk



def _rows_per_chunk(per_row_elems: int) -> int:
    """Rows per chunk for ~4 fp32 work tensors of ``per_row_elems`` each within ``CHUNK_BYTES``."""
    return chunk_rows(16 * per_row_elems)


@torch.no_grad()
def compute_sparse_attention_target(query_SbnH: torch.Tensor, key_TbnH: torch.Tensor, topk_bSK: torch.Tensor,
                                    scale: float, tp_group=None) -> torch.Tensor:
    """Megatron-Core's sparse indexer target on the selected keys: per head softmax(q·k·scale) over
    each query's selected keys, summed over heads (all-reduced over ``tp_group``, which holds the
    other heads), L1-normalised. query [S, b, n, h], key [T, b, n, h], topk [b, S, K] (-1 = none)
    → float32 [b, S, K], 0 where not selected."""
    S, b, n, h = query_SbnH.shape
    T, K = key_TbnH.shape[0], topk_bSK.shape[-1]
    q = query_SbnH.permute(2, 1, 0, 3).reshape(n, b * S, 1, h).float()  # head-major, as the sparse core
    k = key_TbnH.permute(2, 1, 0, 3).reshape(n, b * T, h).float()
    idx = flat_topk(topk_bSK, T)
    out = torch.empty(b * S, K, dtype=torch.float32, device=q.device)
    rows = _rows_per_chunk(K * n * h)
    for r0 in range(0, b * S, rows):
        r1 = min(b * S, r0 + rows)
        valid = (idx[r0:r1] >= 0).expand(n, -1, -1)
        kg = k[:, idx[r0:r1].clamp(min=0)]  # [n, C, K, h]
        logits = torch.matmul(q[:, r0:r1], kg.transpose(-1, -2)).squeeze(2).mul_(scale)  # [n, C, K]
        out[r0:r1] = logits.masked_fill_(~valid, float("-inf")).softmax(-1).sum(0)  # every row selects >= 1 key
        del valid, kg, logits  # before the next chunk's are made
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(out, group=tp_group)
    return dsa_indexer_loss.normalize_indexer_target(out).view(b, S, K)


@torch.no_grad()
def compute_sparse_attention_target_latent(q_RnD: torch.Tensor, lat_TD: torch.Tensor, topk_bSK: torch.Tensor,
                                           scale: float, tp_group=None) -> torch.Tensor:
    """``compute_sparse_attention_target`` in the absorbed MLA form: q·k = q_abs·lat (see
    ``sparse_attention.absorbed_sparse_attention``), so each query's selected latent rows are gathered once for all
    heads ([C, K, D], n times less than per-head keys). q [b·S, n, D], lat [b·T, D] → [b, S, K]."""
    b, S, K = topk_bSK.shape
    R, n, D = q_RnD.shape
    idx = flat_topk(topk_bSK, lat_TD.shape[0] // b)
    if kernels.use_for(q_RnD, lat_TD):
        out = kernels.sparse_latent_target(q_RnD, lat_TD, idx, scale)
    else:
        out = torch.empty(R, K, dtype=torch.float32, device=q_RnD.device)
        rows = _rows_per_chunk(K * (D + n))
        for r0 in range(0, R, rows):
            r1 = min(R, r0 + rows)
            valid = (idx[r0:r1] >= 0)[:, None, :].expand(-1, n, -1)
            lg = lat_TD[idx[r0:r1].clamp(min=0)].float()  # [C, K, D]
            logits = torch.bmm(q_RnD[r0:r1].float(), lg.transpose(1, 2)).mul_(scale)  # [C, n, K]
            out[r0:r1] = logits.masked_fill_(~valid, float("-inf")).softmax(-1).sum(1)  # every row selects >= 1 key
            del valid, lg, logits  # before the next chunk's are made
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(out, group=tp_group)
    return dsa_indexer_loss.normalize_indexer_target(out).view(b, S, K)


def _index_scores(q_CnD, w_Cn, kg_CKD):
    """I [C, K] = Σ_h w·ReLU(q·k) and the pre-ReLU products [C, n, K]."""
    dots = torch.einsum("cnd,ckd->cnk", q_CnD, kg_CKD)
    return torch.einsum("cn,cnk->ck", w_Cn, dots.clamp(min=0)), dots


class SparseIndexerKL(torch.autograd.Function):
    """Σ over query rows of KL(target || softmax over the selected keys of the indexer scores).

    q [R, nI, dI], w [R, nI], k [b·T, dI] (flattened like ``flat_topk``), idx [R, K] (-1 = not selected),
    target [R, K] (rows sum to 1 over the selected keys) → scalar float32, unscaled sum over rows.
    Gradients reach q, w and k only; the saved state is the inputs (chunks are recomputed). On CPU the
    fused kernel (``kernels.indexer_kl`` / ``indexer_kl_grad``) does the same per row.
    """

    @staticmethod
    def forward(ctx, q, w, k, idx, target):
        ctx.save_for_backward(q, w, k, idx, target)
        if kernels.use_for(q, w, k):
            return kernels.indexer_kl(q, w, k, idx, target).sum()
        R, K = idx.shape
        total = torch.zeros((), dtype=torch.float32, device=q.device)
        kf = k.float()
        rows = _rows_per_chunk(K * (q.shape[1] + q.shape[2]))
        for r0 in range(0, R, rows):
            r1 = min(R, r0 + rows)
            valid = idx[r0:r1] >= 0
            scores, dots = _index_scores(q[r0:r1].float(), w[r0:r1].float(), kf[idx[r0:r1].clamp(min=0)])
            logp = scores.masked_fill_(~valid, float("-inf")).log_softmax(-1)  # every row selects >= 1 key
            total += dsa_indexer_loss.indexer_kl_sum(target[r0:r1], logp, valid)
            del valid, scores, dots, logp  # before the next chunk's are made
        return total

    @staticmethod
    def backward(ctx, grad):
        q, w, k, idx, target = ctx.saved_tensors
        if kernels.use_for(q, w, k):
            dq, dw, dk = kernels.indexer_kl_grad(q, w, k, idx, target, float(grad))
            return dq.to(q.dtype), dw.to(w.dtype), dk.to(k.dtype), None, None
        R, K = idx.shape
        kf = k.float()
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # chunks computed in fp32, stored in q's dtype
        dw = torch.empty(w.shape, dtype=w.dtype, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)  # accumulated over chunks: fp32
        g = grad.float()
        rows = _rows_per_chunk(K * (q.shape[1] + q.shape[2]))
        for r0 in range(0, R, rows):
            r1 = min(R, r0 + rows)
            valid = idx[r0:r1] >= 0
            sel = idx[r0:r1].clamp(min=0)
            qc, wc, kg = q[r0:r1].float(), w[r0:r1].float(), kf[sel]
            scores, dots = _index_scores(qc, wc, kg)
            p = scores.masked_fill_(~valid, float("-inf")).softmax(-1)
            t = target[r0:r1]
            dI = g * (p * t.sum(-1, keepdim=True) - t)  # d KL / d I over the selected keys, [C, K]
            dw[r0:r1] = torch.einsum("ck,cnk->cn", dI, dots.clamp(min=0))
            dr = dI[:, None, :] * wc[:, :, None] * (dots > 0)  # [C, n, K]
            dq[r0:r1] = torch.einsum("cnk,ckd->cnd", dr, kg)
            dk.index_add_(0, sel.reshape(-1), torch.einsum("cnk,cnd->ckd", dr, qc).reshape(-1, k.shape[-1]))
            del valid, sel, qc, wc, kg, scores, dots, p, t, dI, dr  # before the next chunk's are made
        return dq, dw, dk.to(k.dtype), None, None


def _dense_target(query_CnH, keyf_TnH, allowed_CT, scale, tp_group):
    """Megatron-Core's dense warm-up target for a chunk of rows: per head softmax(q·k·scale) over the
    allowed keys, summed over heads (all-reduced over ``tp_group``), L1-normalised. ``keyf`` fp32; the
    softmax is taken in place (one [C, n, T] fp32 tensor). [C, T] fp32."""
    p = torch.einsum("cnh,tnh->cnt", query_CnH.float(), keyf_TnH).mul_(scale)
    p.masked_fill_(~allowed_CT[:, None], float("-inf"))
    p.sub_(p.amax(-1, keepdim=True)).exp_()  # every row allows >= 1 key (its own)
    att = p.div_(p.sum(-1, keepdim=True)).sum(1)
    del p
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(att, group=tp_group)
    return dsa_indexer_loss.normalize_indexer_target(att)


def dense_kl_row_bytes(T: int, n: int, nI: int) -> int:
    """Working bytes of one query row in ``DenseIndexerKL`` at its fullest (its chunks' size, the planner's
    too): the larger of the target's fp32 head scores [n, T] and the indexer's fp32 ReLU(q·k) [nI, T]
    (both worked in place), and the fp32 / bool rows [T] beside them (the target, the scores and their
    softmax, the allowed mask)."""
    return 4 * T * max(n, nI) + 14 * T


def _relu_dots(q_CnD, kf_TD):
    """ReLU(q·k) [C, nI, T] fp32 of a chunk of the indexer's queries against every key."""
    return torch.einsum("cnd,td->cnt", q_CnD.float(), kf_TD).clamp_(min=0)


class DenseIndexerKL(torch.autograd.Function):
    """The indexer warm-up's dense KL, chunked by query rows so no [S, T] (nor [n, S, T]) tensor is ever
    held: Σ over rows of KL(target || softmax over the allowed keys of I), target as
    ``_dense_target``, I[t, u] = Σ_h w[t,h]·ReLU(q[t,h]·k[u]). Megatron-Core's
    ``compute_dsa_indexer_loss(sparse_loss=False)`` computes the same sum on full [b, n, S, T] tensors.

    q [S, b, nI, dI], w [S, b, nI], k [T, b, dI] (the indexer's outputs: gradients reach them),
    query [S, b, n, h], key [T, b, n, h] (detached), q_pos / doc_start [S]. Returns (Σ KL, Σ over
    rows with more than K allowed keys of the target mass inside the row's deterministic top-K,
    #such rows), the last two without grad. Saved: the inputs; backward recomputes each chunk. Chunks
    hold ``dense_kl_row_bytes`` per row within ``CHUNK_BYTES``; the keys are made fp32 once per sequence.
    """

    @staticmethod
    def forward(ctx, q, w, k, query, key, q_pos, doc_start, scale, K, tp_group):
        S, b, nI, _ = q.shape
        T, n = key.shape[0], key.shape[2]
        key_pos = torch.arange(T, device=q.device)
        kl = torch.zeros((), dtype=torch.float32, device=q.device)
        mass = torch.zeros((), dtype=torch.float32, device=q.device)
        rows_n = torch.zeros((), dtype=torch.int64, device=q.device)
        rows = chunk_rows(dense_kl_row_bytes(T, n, nI))
        for bi in range(b):
            kf, keyf = k[:, bi].float(), key[:, bi].float()
            for s0 in range(0, S, rows):
                s1 = min(S, s0 + rows)
                allowed = (key_pos[None, :] <= q_pos[s0:s1, None]) & (key_pos[None, :] >= doc_start[s0:s1, None])
                target = _dense_target(query[s0:s1, bi], keyf, allowed, scale, tp_group)
                rel = _relu_dots(q[s0:s1, bi], kf)
                scores = torch.einsum("cn,cnt->ct", w[s0:s1, bi].float(), rel).masked_fill_(~allowed, float("-inf"))
                del rel
                kl += dsa_indexer_loss.indexer_kl_sum(target, scores.log_softmax(-1), allowed)
                top = deterministic_topk(scores, min(K, T))
                choice = allowed.sum(-1) > K  # rows where the top-k is a real choice
                got = target.gather(-1, top.clamp(min=0)).masked_fill_(top < 0, 0.0).sum(-1)
                mass += (got * choice).sum()
                rows_n += choice.sum()
                del allowed, target, scores, top, choice, got  # before the next chunk's are made
            del kf, keyf
        ctx.save_for_backward(q, w, k, query, key, q_pos, doc_start)
        ctx.scale, ctx.tp_group = scale, tp_group
        ctx.mark_non_differentiable(mass, rows_n)
        return kl, mass, rows_n

    @staticmethod
    def backward(ctx, grad, _g_mass, _g_rows):
        q, w, k, query, key, q_pos, doc_start = ctx.saved_tensors
        S, b, nI, _ = q.shape
        T, n = key.shape[0], key.shape[2]
        key_pos = torch.arange(T, device=q.device)
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # chunks computed in fp32, stored in q's dtype
        dw = torch.empty(w.shape, dtype=w.dtype, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)  # accumulated over chunks: fp32
        g = grad.float()
        rows = chunk_rows(dense_kl_row_bytes(T, n, nI))
        for bi in range(b):
            kf, keyf = k[:, bi].float(), key[:, bi].float()
            for s0 in range(0, S, rows):
                s1 = min(S, s0 + rows)
                allowed = (key_pos[None, :] <= q_pos[s0:s1, None]) & (key_pos[None, :] >= doc_start[s0:s1, None])
                t = _dense_target(query[s0:s1, bi], keyf, allowed, ctx.scale, ctx.tp_group)
                qc, wc = q[s0:s1, bi].float(), w[s0:s1, bi].float()
                rel = _relu_dots(qc, kf)
                scores = torch.einsum("cn,cnt->ct", wc, rel).masked_fill_(~allowed, float("-inf"))
                dI = scores.softmax(-1).mul_(t.sum(-1, keepdim=True)).sub_(t).mul_(g)  # d KL / d I, [C, T]
                del allowed, t, scores
                dw[s0:s1, bi] = torch.einsum("ct,cnt->cn", dI, rel)
                dr = rel.gt_(0).mul_(dI[:, None, :]).mul_(wc[:, :, None])  # [C, nI, T], in place of rel
                dq[s0:s1, bi] = torch.einsum("cnt,td->cnd", dr, kf)
                dk[:, bi] += torch.einsum("cnt,cnd->td", dr, qc)
                del qc, wc, rel, dI, dr  # before the next chunk's are made
            del kf, keyf
        return dq, dw, dk.to(k.dtype), None, None, None, None, None, None, None


def compute_sparse_indexer_loss(q_SbnD: torch.Tensor, w_Sbn: torch.Tensor, k_TbD: torch.Tensor,
                                topk_bSK: torch.Tensor, target_bSK: torch.Tensor, loss_coeff: float,
                                calculate_per_token_loss: bool, query_valid_rows: Optional[torch.Tensor] = None
                                ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(loss, Σ_rows KL detached, #rows counted: an int, a 0-dim tensor off the CPU): Megatron-Core's sparse indexer loss on the gathered form.

    q [S, b, nI, dI], w [S, b, nI], k [T, b, dI] are the indexer's outputs (they carry its grads);
    topk / target [b, S, K]; ``query_valid_rows`` (bool [b, S], Megatron's ``real_token_mask_q``) drops
    padding rows. The loss is ``loss_coeff`` × (Σ KL over rows, or its mean over rows unless
    ``calculate_per_token_loss``), as ``dsa_indexer_loss.indexer_loss_from_target`` reduces it."""
    S, b = q_SbnD.shape[:2]
    T = k_TbD.shape[0]
    q = q_SbnD.transpose(0, 1).reshape(b * S, *q_SbnD.shape[2:])
    w = w_Sbn.transpose(0, 1).reshape(b * S, -1)
    k = k_TbD.transpose(0, 1).reshape(b * T, -1)
    target = target_bSK.reshape(b * S, -1)
    rows, count = b * S, None
    if query_valid_rows is not None:  # a zero target row adds nothing to the KL nor to its gradient
        keep = query_valid_rows.reshape(b * S)
        target = target * keep[:, None]
        count = keep.sum()
        rows = int(count) if keep.device.type == "cpu" else count  # no host read on an accelerator
    kl_sum = SparseIndexerKL.apply(q, w, k, flat_topk(topk_bSK, T), target)
    loss = dsa_indexer_loss.reduce_indexer_kl_sum(kl_sum, num_rows=b * S, valid_row_count=count,
                                                  calculate_per_token_loss=calculate_per_token_loss)
    return loss * loss_coeff, kl_sum.detach(), rows


@torch.no_grad()
def compute_topk_recall(query_SbnH: torch.Tensor, key_TbnH: torch.Tensor, topk_bSK: torch.Tensor,
                        q_pos_S: torch.Tensor, doc_start_S: torch.Tensor, scale: float, tp_group=None,
                        max_rows: int = 128) -> tuple[torch.Tensor, int | torch.Tensor]:
    """(Σ recall as a 0-dim tensor on the inputs' device, #rows): for each sampled query row with more
    allowed keys than K, the share of its dense attention mass (softmax over doc_start ≤ u ≤ pos, summed
    over all heads) inside its top-k.

    key [T, b, n, h], or [T, b, 1, h] for one key shared by every head (the absorbed query and the
    latent). On the CPU rows are taken evenly spaced from the eligible ones, at most ``max_rows`` per
    call, and #rows is an int; on an accelerator (no host read) ``max_rows`` evenly spaced rows are
    taken, the ineligible ones masked out, and #rows is a 0-dim tensor. The cost is that of
    ``max_rows`` dense attention rows. Under TP every rank samples the same rows and the head sums
    are all-reduced."""
    S, b, n, _ = query_SbnH.shape
    T, K = key_TbnH.shape[0], topk_bSK.shape[-1]
    dev = query_SbnH.device
    eligible = (q_pos_S - doc_start_S + 1) > K  # [S]
    per_b = max(1, max_rows // max(1, b))
    if dev.type == "cpu":
        cand = eligible.nonzero().squeeze(1)
        if cand.numel() == 0 or b == 0:
            return torch.zeros((), device=dev), 0
        if cand.numel() > per_b:
            cand = cand[torch.linspace(0, cand.numel() - 1, per_b, device=dev).round().long()]
        keep = None
    else:
        cand = torch.linspace(0, S - 1, min(S, per_b), device=dev).round().long()
        keep = eligible[cand]
    key_pos = torch.arange(T, device=dev)
    mass = torch.zeros(b, cand.numel(), dtype=torch.float32, device=dev)
    rows = _rows_per_chunk(n * T)
    shared = key_TbnH.shape[2] == 1
    for bi in range(b):
        kf = key_TbnH[:, bi].float()
        for c0 in range(0, cand.numel(), rows):
            r = cand[c0: c0 + rows]
            allowed = (key_pos[None, :] <= q_pos_S[r, None]) & (key_pos[None, :] >= doc_start_S[r, None])
            qr = query_SbnH[r, bi].float()
            logits = (torch.einsum("cnh,th->cnt", qr, kf[:, 0]) if shared else torch.einsum("cnh,tnh->cnt", qr, kf))
            p = (logits * scale).masked_fill(~allowed[:, None], float("-inf")).softmax(-1).sum(1)  # [C, T]
            sel = topk_bSK[bi, r].long()
            mass[bi, c0: c0 + r.numel()] = p.gather(-1, sel.clamp(min=0)).masked_fill(sel < 0, 0.0).sum(-1)
            del r, allowed, qr, logits, p, sel  # before the next chunk's are made
    heads = n
    if tp_group is not None and dist.get_world_size(tp_group) > 1:
        dist.all_reduce(mass, group=tp_group)
        heads *= dist.get_world_size(tp_group)  # TP splits the heads evenly
    if keep is None:
        return (mass / heads).sum(), mass.numel()
    mass = mass.nan_to_num_(0.0) * keep  # ineligible sampled rows (fully masked ones give NaN) count 0
    return (mass / heads).sum(), keep.sum() * b


def indexer_trainable(indexer: Optional[torch.nn.Module]) -> bool:
    """Whether any parameter of the indexer (LoRA adapters on its linears included) takes gradients."""
    return indexer is not None and any(p.requires_grad for p in indexer.parameters())

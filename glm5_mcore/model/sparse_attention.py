"""DSA tensor math and autograd: the indexer's scoring + deterministic top-k, and sparse attention over
each query's selected keys (per-head and absorbed-latent forms), plus the dense attention DSA reduces to.

- ``compute_index_topk``: ReLU(q·k) scores weighted per head, causal + document bounds from the
  packed-sequence boundaries, and a *deterministic* top-k (ties go to the lower key index, the same
  on every device), computed in query chunks so the indexer's T² scoring is never held at once.
- ``SparseMLAAttention``: attention over the selected keys only. Memory is O(T·k): scores are formed
  per query chunk as [C, heads, k] and recomputed in backward (flash-style, saving only the
  log-sum-exp); there is no [T, T] score or mask tensor.
- ``SparseLatentAttention``: the same in the absorbed MLA form (FlashMLA-sparse style): scores
  ``(q_nope·W_uk)·c + q_rope·k_rope`` over the shared kv latent ``c``, gathered once per query for
  all heads; the default wherever the core can capture its MLA's normalised latent.

Legend: S query rows, T key rows, b batch, n heads, h head dim, K top-k, C query-chunk rows.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from glm5_mcore import kernels

_SCORE_ELEMS_PER_CHUNK = 1 << 22


# --------------------------------------------------------------------------------------------------
# Indexer scoring and deterministic top-k
# --------------------------------------------------------------------------------------------------
def deterministic_topk(scores_CT: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k indices along the last dim with ties broken towards the lower index.

    ``torch.topk`` leaves tie order to the kernel, which only matters in rows where the k-th largest
    value is tied beyond the set (more than k entries >= it): those rows are rebuilt from the k-th
    value — every entry above it, then entries equal to it in index order until k are taken. Same
    set as a stable descending sort (training and rollout engines agree); other rows keep
    ``topk``'s set. Chosen indices come back in ascending order, then -1 for each ``-inf`` entry
    topk had to take (fewer than k finite scores). CPU tensors go through the fused selection
    kernel (``glm5_mcore.kernels``, same sets).
    """
    if kernels.use_for(scores_CT):
        lead, L = scores_CT.shape[:-1], scores_CT.shape[-1]
        flat = scores_CT.reshape(-1, L)
        R = flat.shape[0]
        lo = torch.zeros(R, dtype=torch.int64)
        return kernels.topk_rows(flat, lo, lo + L, k).view(*lead, k)
    vals, idx = torch.topk(scores_CT, k, dim=-1, sorted=False)
    kth = vals.amin(-1, keepdim=True)
    idx = idx.sort(-1).values
    tied = (scores_CT >= kth).sum(-1) > k
    if bool(tied.any()):
        rows = tied.nonzero(as_tuple=True)
        sub, sub_kth = scores_CT[rows], kth[rows]
        above, eq = sub > sub_kth, sub == sub_kth
        chosen = above | (eq & (eq.cumsum(-1) <= k - above.sum(-1, keepdim=True)))
        idx[rows] = chosen.nonzero()[:, -1].view(-1, k)
    L = scores_CT.shape[-1]
    idx = idx.masked_fill(scores_CT.gather(-1, idx) == float("-inf"), L).sort(-1).values
    return idx.masked_fill(idx == L, -1)


def allowed_keys(key_pos_T: torch.Tensor, q_pos_S: torch.Tensor, doc_start_S: torch.Tensor) -> torch.Tensor:
    """[S, T] bool: key u is visible to query t iff doc_start(t) ≤ u ≤ pos(t) (causal, own document)."""
    return (key_pos_T[None, :] <= q_pos_S[:, None]) & (key_pos_T[None, :] >= doc_start_S[:, None])


def compute_index_topk(
    q_SbnD: torch.Tensor,
    k_TbD: torch.Tensor,
    w_Sbn: torch.Tensor,
    topk: int,
    q_pos_S: torch.Tensor,
    doc_start_S: torch.Tensor,
) -> torch.Tensor:
    """Indexer top-k: I[t,u] = Σ_h w[t,h]·ReLU(q[t,h]·k[u]) over keys doc_start(t) ≤ u ≤ pos(t).

    Args:
        q_SbnD: indexer queries (RoPE applied), [S, b, nI, dI].
        k_TbD: indexer keys in global key order, [T, b, dI].
        w_Sbn: head weights, already scaled by nI^-0.5·dI^-0.5, [S, b, nI].
        q_pos_S / doc_start_S: each query's key-order position and its document's first key, [S].
    Returns:
        int64 [b, S, K], K = min(topk, T): each row's keys ascending, then -1 where fewer than K
        keys are allowed. On CPU the fused kernel scores and selects one row at a time.
    """
    S, b = q_SbnD.shape[:2]
    T = k_TbD.shape[0]
    K = min(topk, T)
    if kernels.use_for(q_SbnD, k_TbD):
        return torch.stack([kernels.indexer_topk(q_SbnD[:, bi], k_TbD[:, bi], w_Sbn[:, bi], doc_start_S, q_pos_S + 1, K)
                            for bi in range(b)])
    key_pos_T = torch.arange(T, device=q_SbnD.device)
    rows = max(1, _SCORE_ELEMS_PER_CHUNK // max(1, T * q_SbnD.shape[2]))
    out = torch.full((b, S, K), -1, dtype=torch.int64, device=q_SbnD.device)
    kf = k_TbD.float()
    for s0 in range(0, S, rows):
        s1 = min(S, s0 + rows)
        # only the keys some query of the chunk may see: causal (and document) bounds
        lo, hi = int(doc_start_S[s0:s1].min()), int(q_pos_S[s0:s1].max()) + 1
        kk = min(K, hi - lo)
        # keys every query of the chunk may see need no mask: only the bands [lo, max doc start)
        # and (min position, hi) get one
        left = int(doc_start_S[s0:s1].max()) - lo
        right = int(q_pos_S[s0:s1].min()) + 1 - lo
        bands = [(0, left), (max(left, right), hi - lo)]
        masks = [(a, ~allowed_keys(key_pos_T[lo + a: lo + z], q_pos_S[s0:s1], doc_start_S[s0:s1]))
                 for a, z in bands if z > a]
        for bi in range(b):
            qc = q_SbnD[s0:s1, bi].float()
            scores = torch.einsum("cnd,td->cnt", qc, kf[lo:hi, bi]).relu_()
            scores = torch.bmm(w_Sbn[s0:s1, bi].float().unsqueeze(1), scores).squeeze(1)
            for a, m in masks:
                scores[:, a: a + m.shape[1]].masked_fill_(m, float("-inf"))
            idx = deterministic_topk(scores, kk)
            out[bi, s0:s1, :kk] = torch.where(idx >= 0, idx + lo, -1)
    return out


# --------------------------------------------------------------------------------------------------
# Sparse attention core
# --------------------------------------------------------------------------------------------------
def _chunk_rows(K: int, n: int) -> int:
    return max(1, _SCORE_ELEMS_PER_CHUNK // (8 * max(1, K * n)))


def _latent_chunk_rows(K: int, D: int) -> int:
    """Query rows per chunk of the latent core: the gathered [C, K, D] block stays ~4M floats."""
    return max(1, _SCORE_ELEMS_PER_CHUNK // max(1, K * D))


class SparseMLAAttention(torch.autograd.Function):
    """softmax(q·k_sel·scale)·v_sel over each query's selected keys, O(S·K) memory.

    Head-major inputs: q [n, S, h], k [n, T, h], v [n, T, hv], idx [S, K] (int64 into T, -1 = not
    selected). Per query chunk the selected keys are gathered once as [n, C, K, h] and scored with
    batched matmuls in fp32; backward recomputes the chunk's probabilities from the saved
    log-sum-exp [n, S] and scatters key/value grads with ``index_add_``.
    """

    @staticmethod
    def forward(ctx, q, k, v, idx, scale):
        n, S, _ = q.shape
        out = torch.empty(n, S, v.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.empty(n, S, dtype=torch.float32, device=q.device)
        kf, vf = k.float(), v.float()
        rows = _chunk_rows(idx.shape[1], n)
        for s0 in range(0, S, rows):
            s1 = min(S, s0 + rows)
            valid = idx[s0:s1] >= 0
            sel = idx[s0:s1].clamp(min=0)
            logits = torch.matmul(q[:, s0:s1, None].float(), kf[:, sel].transpose(-1, -2)).squeeze(2)
            logits = logits.mul_(scale).masked_fill_(~valid, float("-inf"))
            lse_c = torch.logsumexp(logits, dim=-1)
            p = torch.exp(logits - lse_c[..., None])
            out[:, s0:s1] = torch.matmul(p[:, :, None], vf[:, sel]).squeeze(2)
            lse[:, s0:s1] = lse_c
        ctx.save_for_backward(q, k, v, idx, out, lse)
        ctx.scale = scale
        return out.to(v.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, idx, out, lse = ctx.saved_tensors
        scale = ctx.scale
        n, S, h = q.shape
        hv = v.shape[-1]
        kf, vf = k.float(), v.float()
        dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        dout = dout.float()
        delta = (dout * out).sum(-1)
        rows = _chunk_rows(idx.shape[1], n)
        for s0 in range(0, S, rows):
            s1 = min(S, s0 + rows)
            valid = idx[s0:s1] >= 0
            sel = idx[s0:s1].clamp(min=0)
            kg, vg = kf[:, sel], vf[:, sel]
            qc, do = q[:, s0:s1, None].float(), dout[:, s0:s1, None]
            logits = torch.matmul(qc, kg.transpose(-1, -2)).squeeze(2).mul_(scale)
            p = torch.exp(logits - lse[:, s0:s1, None]).masked_fill_(~valid, 0.0)
            dp = torch.matmul(do, vg.transpose(-1, -2)).squeeze(2)
            ds = p * (dp - delta[:, s0:s1, None]) * scale
            dq[:, s0:s1] = torch.matmul(ds[:, :, None], kg).squeeze(2)
            flat = sel.reshape(-1)
            dk.index_add_(1, flat, (ds[..., None] * qc).reshape(n, -1, h))
            dv.index_add_(1, flat, (p[..., None] * do).reshape(n, -1, hv))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None


def _flat_topk(topk_bSK: torch.Tensor, T: int) -> torch.Tensor:
    """[b, S, K] key indices → [b·S, K] indices into the batch-merged key axis (b·T), -1 kept."""
    b = topk_bSK.shape[0]
    if b == 1:
        return topk_bSK.reshape(-1, topk_bSK.shape[-1])
    offsets = (torch.arange(b, device=topk_bSK.device) * T)[:, None, None]
    return torch.where(topk_bSK >= 0, topk_bSK + offsets, -1).reshape(-1, topk_bSK.shape[-1])


def sparse_attention(q_SbnH, k_TbnH, v_TbnV, topk_bSK, scale):
    """Batch wrapper: [S,b,n,h] queries, [T,b,n,h]/[T,b,n,hv] keys/values, [b,S,K] indices →
    [S, b, n·hv]."""
    S, b, n, _ = q_SbnH.shape
    T = k_TbnH.shape[0]
    idx = _flat_topk(topk_bSK, T)
    q = q_SbnH.permute(2, 1, 0, 3).reshape(n, b * S, -1)
    k = k_TbnH.permute(2, 1, 0, 3).reshape(n, b * T, -1)
    v = v_TbnV.permute(2, 1, 0, 3).reshape(n, b * T, -1)
    out = SparseMLAAttention.apply(q, k, v, idx, scale)  # [n, b*S, hv]
    return out.reshape(n, b, S, -1).permute(2, 1, 0, 3).reshape(S, b, -1)


class SparseLatentAttention(torch.autograd.Function):
    """Absorbed-MLA sparse attention: every head attends over the selected rows of one shared latent.

    q [S, n, D] (absorbed query: q_nope·W_uk ⊕ q_rope), lat [T, D] (kv latent ⊕ rope key), idx [S, K]
    (-1 = not selected) → out [S, n, dc], the attention-weighted latent (its first ``dc`` dims).
    Per query chunk the selected latent rows are gathered once for all heads as [C, K, D] — n times
    less gathered memory than per-head keys and values — and scored with batched matmuls in fp32;
    backward recomputes the probabilities from the saved log-sum-exp [S, n]. On CPU the fused
    kernel (``glm5_mcore.kernels``) does the same per query, reading latent rows in place.
    """

    @staticmethod
    def forward(ctx, q, lat, idx, scale, dc):
        S, n, D = q.shape
        K = idx.shape[1]
        ctx.scale, ctx.dc = scale, dc
        if kernels.use_for(q, lat):
            out, lse = kernels.sparse_latent_fwd(q, lat, idx, scale, dc)
            ctx.save_for_backward(q, lat, idx, out, lse)
            return out.to(lat.dtype)
        out = torch.empty(S, n, dc, dtype=torch.float32, device=q.device)
        lse = torch.empty(S, n, dtype=torch.float32, device=q.device)
        latf = lat.float()
        rows = _latent_chunk_rows(K, D)
        for s0 in range(0, S, rows):
            s1 = min(S, s0 + rows)
            valid = (idx[s0:s1] >= 0)[:, None, :]
            lg = latf[idx[s0:s1].clamp(min=0)]  # [C, K, D]
            logits = torch.bmm(q[s0:s1].float(), lg.transpose(1, 2)).mul_(scale).masked_fill_(~valid, float("-inf"))
            lse_c = torch.logsumexp(logits, dim=-1)
            p = torch.exp(logits - lse_c[..., None])
            out[s0:s1] = torch.bmm(p, lg[..., :dc])
            lse[s0:s1] = lse_c
        ctx.save_for_backward(q, lat, idx, out, lse)
        return out.to(lat.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, lat, idx, out, lse = ctx.saved_tensors
        scale, dc = ctx.scale, ctx.dc
        S, n, D = q.shape
        K = idx.shape[1]
        if kernels.use_for(q, lat):
            dq, dlat = kernels.sparse_latent_bwd(q, lat, idx, out, lse, dout, scale, dc)
            return dq.to(q.dtype), dlat.to(lat.dtype), None, None, None
        latf = lat.float()
        dq = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dlat = torch.zeros(lat.shape, dtype=torch.float32, device=q.device)
        dout = dout.float()
        delta = (dout * out).sum(-1)  # [S, n]
        rows = _latent_chunk_rows(K, D)
        for s0 in range(0, S, rows):
            s1 = min(S, s0 + rows)
            valid = (idx[s0:s1] >= 0)[:, None, :]
            sel = idx[s0:s1].clamp(min=0)
            lg = latf[sel]
            qc = q[s0:s1].float()
            logits = torch.bmm(qc, lg.transpose(1, 2)).mul_(scale)
            p = torch.exp(logits - lse[s0:s1, :, None]).masked_fill_(~valid, 0.0)  # [C, n, K]
            dp = torch.bmm(dout[s0:s1], lg[..., :dc].transpose(1, 2))
            ds = p * (dp - delta[s0:s1, :, None]) * scale
            dq[s0:s1] = torch.bmm(ds, lg)
            dlg = torch.bmm(ds.transpose(1, 2), qc)  # [C, K, D]
            dlg[..., :dc] += torch.bmm(p.transpose(1, 2), dout[s0:s1])
            dlat.index_add_(0, sel.reshape(-1), dlg.reshape(-1, D))
        return dq.to(q.dtype), dlat.to(lat.dtype), None, None, None


def absorbed_sparse_attention(q_SbnH, k_rope_Tbr, c_Tbc, w_kv_up, topk_bSK, scale, dn, dv,
                              stash: Optional[list] = None):
    """Sparse MLA in the absorbed form. q [S, b, n, dn+dr], k_rope [T, b, dr], latent c [T, b, dc],
    ``w_kv_up`` [n·(dn+dv), dc] (per head: dn key rows then dv value rows) → [S, b, n·dv].

    q·k = (q_nope·W_uk)·c + q_rope·k_rope and Σ p·v = W_uv·(Σ p·c): the same function as attention over
    the expanded per-head keys and values. ``stash`` gets the detached absorbed query [b·S, n, D] and
    latent [b·T, D] (the sparse indexer loss's target reads them)."""
    S, b, n, _ = q_SbnH.shape
    T, dc = c_Tbc.shape[0], c_Tbc.shape[-1]
    w = w_kv_up.view(n, dn + dv, dc)
    q_abs = torch.einsum("sbnd,ndc->bsnc", q_SbnH[..., :dn], w[:, :dn])
    q_cat = torch.cat([q_abs, q_SbnH[..., dn:].transpose(0, 1)], dim=-1).reshape(b * S, n, -1)
    lat = torch.cat([c_Tbc, k_rope_Tbr.to(c_Tbc.dtype)], dim=-1).transpose(0, 1).reshape(b * T, -1)
    idx = _flat_topk(topk_bSK, T)
    if stash is not None:
        stash[:] = [q_cat.detach(), lat.detach()]
    o = SparseLatentAttention.apply(q_cat.contiguous(), lat.contiguous(), idx, scale, dc)  # [b*S, n, dc]
    out = torch.einsum("xnc,nvc->xnv", o, w[:, dn:])  # [b*S, n, dv]
    return out.reshape(b, S, n * dv).transpose(0, 1).contiguous()


def dense_attention(q_SbnH, k_TbnH, v_TbnV, q_pos_S, doc_start_S, scale):
    """Plain causal (and document-bounded) attention; what DSA reduces to when K ≥ T.

    Packed documents without context parallelism run one causal SDPA per document (Σ Lᵢ² work);
    otherwise one SDPA with an explicit [S, T] causal + document mask."""
    S, b, n, _ = q_SbnH.shape
    T = k_TbnH.shape[0]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q_SbnH, k_TbnH, v_TbnV))
    natural = S == T and bool((q_pos_S == torch.arange(S, device=q.device)).all())
    if natural and not bool(doc_start_S.any()):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    elif natural:
        starts = torch.unique_consecutive(doc_start_S).tolist() + [S]
        out = torch.cat([F.scaled_dot_product_attention(q[:, :, a:e], k[:, :, a:e], v[:, :, a:e], is_causal=True,
                                                        scale=scale) for a, e in zip(starts[:-1], starts[1:])], 2)
    else:
        key_pos = torch.arange(T, device=q.device)
        mask = allowed_keys(key_pos, q_pos_S, doc_start_S)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.permute(2, 0, 1, 3).reshape(S, b, -1)

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

from typing import Callable, Optional

import os

import torch
import torch.nn.functional as F

from glm5_mcore import kernels

CHUNK_BYTES = int(os.environ.get("GLM5_DSA_CHUNK_MB", "1024")) << 20
"""Working-memory budget of one query chunk of the PyTorch paths (indexer scoring, sparse core,
loss targets): rows per chunk = budget / bytes per row (``GLM5_DSA_CHUNK_MB``, default 1 GiB)."""


def chunk_rows(bytes_per_row: int, budget: int | None = None) -> int:
    """Query rows per chunk so one chunk's transients stay within ``budget`` (``CHUNK_BYTES``)."""
    return max(1, (CHUNK_BYTES if budget is None else budget) // max(1, bytes_per_row))


# --------------------------------------------------------------------------------------------------
# Indexer scoring and deterministic top-k
# --------------------------------------------------------------------------------------------------
def deterministic_topk(scores_CT: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k indices along the last dim with ties broken towards the lower index.

    The set is that of a stable descending sort: every entry above the k-th largest value, then
    entries equal to it in index order until k are taken (training and rollout engines agree; a
    plain ``torch.topk`` leaves the tie order to the kernel). Chosen indices come back ascending,
    then -1 for each ``-inf`` entry that had to be taken (fewer than k finite scores). No host read:
    the chosen mask is compacted with a cumsum + scatter, so on an accelerator nothing syncs. CPU
    tensors go through the fused selection kernel (``glm5_mcore.kernels``, same sets).
    """
    lead, L = scores_CT.shape[:-1], scores_CT.shape[-1]
    if kernels.use_for(scores_CT):
        flat = scores_CT.reshape(-1, L)
        lo = torch.zeros(flat.shape[0], dtype=torch.int64)
        return kernels.topk_rows(flat, lo, lo + L, k).view(*lead, k)
    kth = torch.topk(scores_CT, k, dim=-1, sorted=False).values.amin(-1, keepdim=True)
    above, eq = scores_CT > kth, scores_CT == kth
    chosen = above | (eq & (eq.cumsum(-1) <= k - above.sum(-1, keepdim=True)))
    chosen &= scores_CT > float("-inf")
    slot = torch.where(chosen, chosen.cumsum(-1) - 1, k)  # rank among the chosen, k = discard
    out = torch.full((*lead, k + 1), -1, dtype=torch.int64, device=scores_CT.device)
    pos = torch.arange(L, device=scores_CT.device).expand_as(slot)
    return out.scatter_(-1, slot, pos)[..., :k]


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
    natural: bool = False,
) -> torch.Tensor:
    """Indexer top-k: I[t,u] = Σ_h w[t,h]·ReLU(q[t,h]·k[u]) over keys doc_start(t) ≤ u ≤ pos(t).

    Args:
        q_SbnD: indexer queries (RoPE applied), [S, b, nI, dI].
        k_TbD: indexer keys in global key order, [T, b, dI].
        w_Sbn: head weights, already scaled by nI^-0.5·dI^-0.5, [S, b, nI].
        q_pos_S / doc_start_S: each query's key-order position and its document's first key, [S].
        natural: ``q_pos_S`` is ``arange(S)`` (no context parallelism), known on the host: each
            chunk then scores only the keys up to its last row.
    Returns:
        int64 [b, S, K], K = min(topk, T): each row's keys ascending, then -1 where fewer than K
        keys are allowed. On CPU the fused kernel scores and selects one row at a time; elsewhere
        query chunks sized by ``CHUNK_BYTES``, with no host read.
    """
    S, b = q_SbnD.shape[:2]
    T = k_TbD.shape[0]
    K = min(topk, T)
    if kernels.use_for(q_SbnD, k_TbD):
        return torch.stack([kernels.indexer_topk(q_SbnD[:, bi], k_TbD[:, bi], w_Sbn[:, bi], doc_start_S, q_pos_S + 1, K)
                            for bi in range(b)])
    nI = q_SbnD.shape[2]
    key_pos_T = torch.arange(T, device=q_SbnD.device)
    rows = chunk_rows(T * (4 * nI + 40))  # fp32 head scores, the row scores, the top-k's masks and ranks
    out = torch.full((b, S, K), -1, dtype=torch.int64, device=q_SbnD.device)
    kf = k_TbD.float()
    for s0 in range(0, S, rows):
        s1 = min(S, s0 + rows)
        hi = min(T, s1) if natural else T  # natural order: no query of the chunk sees a key past s1
        kk = min(K, hi)
        blocked = ~allowed_keys(key_pos_T[:hi], q_pos_S[s0:s1], doc_start_S[s0:s1])
        for bi in range(b):
            scores = torch.einsum("cnd,td->cnt", q_SbnD[s0:s1, bi].float(), kf[:hi, bi]).relu_()
            scores = torch.bmm(w_Sbn[s0:s1, bi].float().unsqueeze(1), scores).squeeze(1)
            out[bi, s0:s1, :kk] = deterministic_topk(scores.masked_fill_(blocked, float("-inf")), kk)
            del scores  # a chunk's transients die before the next chunk's are made (CHUNK_BYTES holds)
        del blocked
    return out


# --------------------------------------------------------------------------------------------------
# Sparse attention core
# --------------------------------------------------------------------------------------------------
class SparseMLAAttention(torch.autograd.Function):
    """softmax(q·k_sel·scale)·v_sel over each query's selected keys, O(S·K) memory.

    Head-major inputs: q [n, S, h], k [n, T, h], v [n, T, hv], idx [S, K] (int64 into T, -1 = not
    selected). Per query chunk (``CHUNK_BYTES``) the selected keys are gathered once as [n, C, K, h]
    and scored with batched matmuls in fp32; backward recomputes the chunk's probabilities from the
    saved log-sum-exp [n, S] and scatters key/value grads with ``index_add_``. Saved: the inputs,
    the output in the inputs' dtype and the fp32 log-sum-exp.
    """

    @staticmethod
    def forward(ctx, q, k, v, idx, scale):
        n, S, h = q.shape
        K, hv = idx.shape[1], v.shape[-1]
        out = torch.empty(n, S, hv, dtype=v.dtype, device=q.device)
        lse = torch.empty(n, S, dtype=torch.float32, device=q.device)
        rows = chunk_rows(n * K * (6 * (h + hv) + 12))
        for s0 in range(0, S, rows):
            s1 = min(S, s0 + rows)
            valid = idx[s0:s1] >= 0
            sel = idx[s0:s1].clamp(min=0)
            logits = torch.matmul(q[:, s0:s1, None].float(), k[:, sel].float().transpose(-1, -2)).squeeze(2)
            logits = logits.mul_(scale).masked_fill_(~valid, float("-inf"))
            lse_c = torch.logsumexp(logits, dim=-1)
            p = torch.exp(logits - lse_c[..., None])
            out[:, s0:s1] = torch.matmul(p[:, :, None], v[:, sel].float()).squeeze(2)
            lse[:, s0:s1] = lse_c
            del valid, sel, logits, lse_c, p  # before the next chunk's are made
        ctx.save_for_backward(q, k, v, idx, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, idx, out, lse = ctx.saved_tensors
        scale = ctx.scale
        n, S, h = q.shape
        K, hv = idx.shape[1], v.shape[-1]
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros(v.shape, dtype=torch.float32, device=q.device)
        rows = chunk_rows(n * K * (14 * (h + hv) + 20))
        for s0 in range(0, S, rows):
            s1 = min(S, s0 + rows)
            valid = idx[s0:s1] >= 0
            sel = idx[s0:s1].clamp(min=0)
            kg, vg = k[:, sel].float(), v[:, sel].float()
            qc, do = q[:, s0:s1, None].float(), dout[:, s0:s1, None].float()
            delta = (do.squeeze(2) * out[:, s0:s1].float()).sum(-1)
            logits = torch.matmul(qc, kg.transpose(-1, -2)).squeeze(2).mul_(scale)
            p = torch.exp(logits - lse[:, s0:s1, None]).masked_fill_(~valid, 0.0)
            dp = torch.matmul(do, vg.transpose(-1, -2)).squeeze(2)
            ds = p * (dp - delta[..., None]) * scale
            dq[:, s0:s1] = torch.matmul(ds[:, :, None], kg).squeeze(2)
            flat = sel.reshape(-1)
            dk.index_add_(1, flat, (ds[..., None] * qc).reshape(n, -1, h))
            dv.index_add_(1, flat, (p[..., None] * do).reshape(n, -1, hv))
            del valid, sel, kg, vg, qc, do, delta, logits, p, dp, ds, flat  # before the next chunk's are made
        return dq, dk.to(k.dtype), dv.to(v.dtype), None, None


def flat_topk(topk_bSK: torch.Tensor, T: int) -> torch.Tensor:
    """[b, S, K] key indices → [b·S, K] indices into the batch-merged key axis (b·T), -1 kept; a view
    for one sequence (nothing copied: the sparse core and the indexer loss save it for backward)."""
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
    idx = flat_topk(topk_bSK, T)
    q = q_SbnH.permute(2, 1, 0, 3).reshape(n, b * S, -1)
    k = k_TbnH.permute(2, 1, 0, 3).reshape(n, b * T, -1)
    v = v_TbnV.permute(2, 1, 0, 3).reshape(n, b * T, -1)
    out = SparseMLAAttention.apply(q, k, v, idx, scale)  # [n, b*S, hv]
    return out.reshape(n, b, S, -1).permute(2, 1, 0, 3).reshape(S, b, -1)


class SparseLatentAttention(torch.autograd.Function):
    """Absorbed-MLA sparse attention: every head attends over the selected rows of one shared latent.

    q [S, n, D] (absorbed query: q_nope·W_uk ⊕ q_rope), lat [T, D] (kv latent ⊕ rope key), idx [S, K]
    (-1 = not selected) → out [S, n, dc], the attention-weighted latent (its first ``dc`` dims), in
    ``lat``'s dtype. Per query chunk (``CHUNK_BYTES``) the selected latent rows are gathered once for
    all heads as [C, K, D] — n times less gathered memory than per-head keys and values — and scored
    with batched matmuls in fp32; backward recomputes the probabilities from the saved log-sum-exp
    [S, n]. Saved, as by the fused SparseMLA kernels: q, lat, idx, out (in lat's dtype: it is also
    the next einsum's saved input, one storage) and the fp32 lse. On CPU the fused kernel
    (``glm5_mcore.kernels``) does the same per query, reading latent rows in place.
    """

    @staticmethod
    def forward(ctx, q, lat, idx, scale, dc):
        S, n, D = q.shape
        K = idx.shape[1]
        ctx.scale, ctx.dc = scale, dc
        if kernels.use_for(q, lat):
            out32, lse = kernels.sparse_latent_fwd(q, lat, idx, scale, dc)
            out = out32.to(lat.dtype)
            ctx.save_for_backward(q, lat, idx, out, lse)
            return out
        out = torch.empty(S, n, dc, dtype=lat.dtype, device=q.device)
        lse = torch.empty(S, n, dtype=torch.float32, device=q.device)
        rows = chunk_rows(K * (6 * D + 12 * n))  # the gathered rows (+ fp32 copy), fp32 logits / probabilities
        for s0 in range(0, S, rows):
            s1 = min(S, s0 + rows)
            valid = (idx[s0:s1] >= 0)[:, None, :]
            lg = lat[idx[s0:s1].clamp(min=0)].float()  # [C, K, D]
            logits = torch.bmm(q[s0:s1].float(), lg.transpose(1, 2)).mul_(scale).masked_fill_(~valid, float("-inf"))
            lse_c = torch.logsumexp(logits, dim=-1)
            p = torch.exp(logits - lse_c[..., None])
            out[s0:s1] = torch.bmm(p, lg[..., :dc])
            lse[s0:s1] = lse_c
            del valid, lg, logits, lse_c, p  # before the next chunk's are made
        ctx.save_for_backward(q, lat, idx, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, lat, idx, out, lse = ctx.saved_tensors
        scale, dc = ctx.scale, ctx.dc
        S, n, D = q.shape
        K = idx.shape[1]
        if kernels.use_for(q, lat):
            dq, dlat = kernels.sparse_latent_bwd(q, lat, idx, out, lse, dout, scale, dc)
            return dq.to(q.dtype), dlat.to(lat.dtype), None, None, None
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        dlat = torch.zeros(lat.shape, dtype=torch.float32, device=q.device)
        rows = chunk_rows(latent_backward_row_bytes(K, D, dc, n))
        for s0 in range(0, S, rows):
            s1 = min(S, s0 + rows)
            valid = (idx[s0:s1] >= 0)[:, None, :]
            sel = idx[s0:s1].clamp(min=0)
            lg = lat[sel].float()
            qc, do = q[s0:s1].float(), dout[s0:s1].float()
            delta = (do * out[s0:s1].float()).sum(-1)  # [C, n]
            logits = torch.bmm(qc, lg.transpose(1, 2)).mul_(scale)
            p = torch.exp(logits - lse[s0:s1, :, None]).masked_fill_(~valid, 0.0)  # [C, n, K]
            dp = torch.bmm(do, lg[..., :dc].transpose(1, 2))
            ds = p * (dp - delta[..., None]) * scale
            dq[s0:s1] = torch.bmm(ds, lg)
            dlg = torch.bmm(ds.transpose(1, 2), qc)  # [C, K, D]
            dlg[..., :dc] += torch.bmm(p.transpose(1, 2), do)
            dlat.index_add_(0, sel.reshape(-1), dlg.reshape(-1, D))
            del valid, sel, lg, qc, do, delta, logits, p, dp, ds, dlg  # before the next chunk's are made
        return dq, dlat.to(lat.dtype), None, None, None


def latent_backward_row_bytes(K: int, D: int, dc: int, n: int) -> int:
    """Working bytes of one query row in ``SparseLatentAttention.backward`` at its fullest (the planner's chunk
    too): the gathered latent rows in fp32 and their gradient [K, D], the p·dout product [K, dc], and
    p / dp / ds with their temporaries, fp32 over n heads."""
    return K * (8 * D + 4 * dc + 20 * n)


def absorbed_query(q_SbnH: torch.Tensor, w_kv_up: torch.Tensor, dn: int, dv: int) -> torch.Tensor:
    """The absorbed query q_nope·W_uk ⊕ q_rope: q [S, b, n, dn+dr], ``w_kv_up`` [n·(dn+dv), dc] (per
    head: dn key rows then dv value rows) → [S, b, n, dc+dr] (a view of a [b, S, n, D] tensor)."""
    n, dc = q_SbnH.shape[2], w_kv_up.shape[-1]
    w = w_kv_up.view(n, dn + dv, dc)
    q_abs = torch.einsum("sbnd,ndc->bsnc", q_SbnH[..., :dn], w[:, :dn])
    return torch.cat([q_abs, q_SbnH[..., dn:].transpose(0, 1).to(q_abs.dtype)], dim=-1).transpose(0, 1)


def latent_attention(q_cat_SbnD, lat_TbD, w_kv_up, topk_bSK, scale, dn, dv, fused: Optional[Callable] = None):
    """Sparse attention of the absorbed query [S, b, n, D] over the shared latent rows [T, b, D] (the
    normalised kv latent ⊕ the rope key: the 576-wide row MLA caches), then W_uv → [S, b, n·dv].

    ``fused`` (Megatron-Core's ``run_fused_absorbed_sparse_attention`` bound to its config, see
    ``dsa_backend.fused_core``) takes query [S, b, n, D], key [T, b, 1, D], topk [b, S, K], scale, dc
    and returns [S, b, n, dc] (None: declined); without it, or when it declines,
    ``SparseLatentAttention`` computes the same function."""
    S, b, n, D = q_cat_SbnD.shape
    T, dc = lat_TbD.shape[0], w_kv_up.shape[-1]
    w = w_kv_up.view(n, dn + dv, dc)
    o = fused(q_cat_SbnD, lat_TbD.unsqueeze(2), topk_bSK, scale, dc) if fused is not None else None
    if o is not None:
        o = o.transpose(0, 1).reshape(b * S, n, dc)
    else:
        o = SparseLatentAttention.apply(q_cat_SbnD.transpose(0, 1).reshape(b * S, n, D).contiguous(),
                                        lat_TbD.transpose(0, 1).reshape(b * T, D).contiguous(),
                                        flat_topk(topk_bSK, T), scale, dc)  # [b*S, n, dc]
    out = torch.einsum("xnc,nvc->xnv", o, w[:, dn:])  # [b*S, n, dv]
    return out.reshape(b, S, n * dv).transpose(0, 1).contiguous()


def absorbed_sparse_attention(q_SbnH, lat_TbD, w_kv_up, topk_bSK, scale, dn, dv, fused: Optional[Callable] = None):
    """Sparse MLA in the absorbed form. q [S, b, n, dn+dr], lat [T, b, dc+dr], ``w_kv_up``
    [n·(dn+dv), dc] → [S, b, n·dv].

    q·k = (q_nope·W_uk)·c + q_rope·k_rope and Σ p·v = W_uv·(Σ p·c): the same function as attention over
    the expanded per-head keys and values (``absorbed_query`` then ``latent_attention``)."""
    return latent_attention(absorbed_query(q_SbnH, w_kv_up, dn, dv), lat_TbD, w_kv_up, topk_bSK, scale, dn, dv,
                            fused)


def dense_attention(q_SbnH, k_TbnH, v_TbnV, q_pos_S, doc_start_S, scale, plain_causal: bool = False):
    """Plain causal (and document-bounded) attention; what DSA reduces to when K ≥ T.

    ``plain_causal`` (known on the host: one unpacked sequence, no context parallelism): one causal
    SDPA. On the CPU (host reads are free) packed documents in natural order run one causal SDPA per
    document (Σ Lᵢ² work). Otherwise one SDPA with an explicit [S, T] causal + document mask, which
    reads nothing back from an accelerator."""
    S, b, n, _ = q_SbnH.shape
    T = k_TbnH.shape[0]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q_SbnH, k_TbnH, v_TbnV))
    natural = docs = None
    if not plain_causal and q.device.type == "cpu":
        natural = S == T and bool((q_pos_S == torch.arange(S, device=q.device)).all())
        docs = bool(doc_start_S.any())
    if plain_causal or (natural and not docs):
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

"""GLM-5 DeepSeek Sparse Attention (DSA) as a Megatron-Core MLA ``core_attention``.

The lightning indexer is Megatron-Core's own ``DSAIndexer`` (wq_b on the q latent, wk + LayerNorm,
weights_proj, partial interleaved RoPE on the first ``qk_pos_emb_head_dim`` dims). This module adds
what GLM-5 training needs around it:

- ``compute_index_topk``: ReLU(q·k) scores weighted per head, causal + document bounds from the
  packed-sequence boundaries, and a *deterministic* top-k (ties go to the lower key index, the same
  on every device), computed in query chunks so the indexer's T² scoring is never held at once.
- ``SparseMLAAttention``: attention over the selected keys only. Memory is O(T·k): scores are formed
  per query chunk as [C, heads, k] and recomputed in backward (flash-style, saving only the
  log-sum-exp); there is no [T, T] score or mask tensor.
- ``SparseLatentAttention``: the same in the absorbed MLA form (FlashMLA-sparse style): scores
  ``(q_nope·W_uk)·c + q_rope·k_rope`` over the shared kv latent ``c``, gathered once per query for
  all heads; the default wherever the core can capture its MLA's normalised latent.
- ``GLM5SparseAttention``: the core attention module: THD packing, allgather context parallel,
  IndexShare (a "shared" layer reuses the previous full layer's top-k), a frozen-indexer switch, and
  the indexer's two training stages: the dense warm-up (``set_indexer_warmup``) and the sparse stage
  (``config.dsa_indexer_loss_coeff`` > 0 with a trainable indexer: Megatron-Core's sparse KL over the
  selected keys, ``glm5_mcore.model.indexer_loss``), each attached with ``DSAIndexerLossAutoScaler``.

Legend: S query rows, T key rows, b batch, n heads, h head dim, K top-k, C query-chunk rows.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.experimental_attention_variant import dsa_layout, dsa_masking
from megatron.core.transformer.experimental_attention_variant.dsa import DSAttentionSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.utils import get_pg_size

from glm5_mcore import kernels
from glm5_mcore.model.indexer_loss import (compute_sparse_attention_target, compute_sparse_attention_target_latent,
                                     compute_sparse_indexer_loss, compute_topk_recall, indexer_trainable)

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


# --------------------------------------------------------------------------------------------------
# The core attention module
# --------------------------------------------------------------------------------------------------
class GLM5SparseAttention(MegatronModule):
    """DSA core attention for ``MLASelfAttention`` (non-absorbed: per-head q/k/v come in).

    ``computes_topk=False`` builds an IndexShare layer: no indexer, top-k taken from the nearest
    earlier full layer (linked by ``link_index_share``).
    """

    requires_dsa_inputs = True

    def __init__(self, config, submodules: DSAttentionSubmodules, layer_number: int, attn_mask_type,
                 attention_type: str, attention_dropout: Optional[float] = None,
                 softmax_scale: Optional[float] = None, k_channels: Optional[int] = None,
                 v_channels: Optional[int] = None, cp_comm_type: Optional[str] = None,
                 pg_collection: Optional[ProcessGroupCollection] = None, computes_topk: bool = True):
        super().__init__(config=config)
        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.layer_number = layer_number
        self.index_topk = config.dsa_indexer_topk
        if softmax_scale is None:
            softmax_scale = (k_channels or config.qk_head_dim + config.qk_pos_emb_head_dim) ** -0.5
        self.softmax_scale = softmax_scale
        self.computes_topk = computes_topk
        self.indexer = (build_module(submodules.indexer, config=config, pg_collection=pg_collection)
                        if computes_topk else None)
        self._topk_source: list = []
        self.last_topk: Optional[torch.Tensor] = None
        self._latent: Optional[torch.Tensor] = None  # kv_layernorm output of this forward (absorbed path)
        self.warmup_coeff = 0.0  # > 0: indexer warm-up (dense attention + KL indexer loss), set_indexer_warmup
        if (config.dsa_indexer_loss_coeff or 0.0) > 0 and not config.dsa_indexer_use_sparse_loss:
            raise ValueError("dsa_indexer_loss_coeff > 0 with dsa_indexer_use_sparse_loss=False (a dense KL "
                             "while attending sparsely) is not supported: the dense form is the indexer "
                             "warm-up stage (set_indexer_warmup)")
        self.recall_rows = 128  # query rows per forward sampled for the top-k recall metric
        self.probe_recall = False  # measure the recall in training forwards without the loss too
        self._absorbed_inputs: list = []  # [absorbed query, latent] of this forward, for the loss target
        self.indexer_stats = [0.0, 0, 0.0, 0]  # Σ KL, #rows, Σ recall, #rows since indexer_metrics read them
        self._kv_up: list = []  # [the parent MLA's linear_kv_up_proj], set by link_absorbed_mla

    def _positions(self, sq: int, device, packed_seq_params: Optional[PackedSeqParams]):
        """Each query's index in the (CP-gathered) key order and its document's first key."""
        cp_group = self.pg_collection.cp
        cp, rank = get_pg_size(cp_group), (cp_group.rank() if get_pg_size(cp_group) > 1 else 0)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu_q, cu_kv = dsa_layout.get_packed_qk_cu_seqlens(packed_seq_params)
            cu_q = cu_q.to(device=device, dtype=torch.int64)
            q_pos, reorder = dsa_layout.build_packed_allgather_cp_query_positions_and_key_reorder(
                cu_q, cu_kv, cp, rank, device, local_output_size=sq)
            doc = torch.searchsorted(cu_q, q_pos, right=True) - 1
            doc_start = cu_q[doc.clamp(max=cu_q.numel() - 1)]
            return q_pos, doc_start, (reorder if cp > 1 else None)
        q_pos = dsa_layout.build_zigzag_cp_local_positions(sq * cp, cp, rank, device)
        reorder = dsa_layout.build_zigzag_allgather_cp_key_reorder(sq, cp, device) if cp > 1 else None
        return q_pos, torch.zeros_like(q_pos), reorder

    def _gather_cp(self, t: torch.Tensor, reorder: Optional[torch.Tensor]) -> torch.Tensor:
        if reorder is None:
            return t
        t = gather_from_sequence_parallel_region(t, group=self.pg_collection.cp)
        return t.index_select(0, reorder)

    def forward(self, query, key, value, attention_mask, x, qr, attn_mask_type=None,
                packed_seq_params: Optional[PackedSeqParams] = None, position_ids=None,
                attention_bias=None, up_v_weight=None):
        """query [S,b,n,h] (or THD [t,n,h]), key [S,b,n,h], value [S,b,n,hv], x [S',b,H],
        qr [S',b,r_q] (S' = S/TP under sequence parallel). Returns [S, b, n·hv] (THD: [t, n·hv])."""
        thd = query.dim() == 3
        if thd:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        sq = query.shape[0]
        q_pos, doc_start, reorder = self._positions(sq, query.device, packed_seq_params)
        key = self._gather_cp(key, reorder)
        value = self._gather_cp(value, reorder)
        skv = key.shape[0]

        if self.warmup_coeff > 0 and self.computes_topk and self.training:
            self._latent = None  # dense attention here: the stashed latent is not used
            out = dense_attention(query, key, value, q_pos, doc_start, self.softmax_scale)
            out = self._warmup_indexer_loss(out, query, key, x, qr, packed_seq_params, reorder, q_pos, doc_start)
            return out.squeeze(1) if thd else out
        learn = self.sparse_loss_active()
        if learn:  # sparse stage: the indexer's outputs keep their graph (its inputs are detached)
            q_i, k_i, w_i = self.indexer.forward_before_topk(x.detach(), qr.detach(), packed_seq_params)
            k_i = self._gather_cp(k_i, reorder)
            selected = compute_index_topk(q_i.detach(), k_i.detach(), w_i.detach(), self.index_topk, q_pos,
                                          doc_start)
            topk = None if self.index_topk >= skv else selected
        elif self.index_topk >= skv:
            topk = None
        elif self.computes_topk:
            with torch.no_grad():
                q_i, k_i, w_i = self.indexer.forward_before_topk(x.detach(), qr.detach(), packed_seq_params)
                k_i = self._gather_cp(k_i, reorder)
                topk = compute_index_topk(q_i, k_i, w_i, self.index_topk, q_pos, doc_start)
        else:
            if not self._topk_source:
                raise RuntimeError(f"layer {self.layer_number}: IndexShare layer not linked to a full layer")
            topk = self._topk_source[0].last_topk
        self.last_topk = topk

        latent, self._latent = self._latent, None
        if topk is None:
            out = dense_attention(query, key, value, q_pos, doc_start, self.softmax_scale)
        elif self._kv_up and latent is not None:
            out = self._absorbed(query, key, latent, topk, reorder, value.shape[-1])
        else:
            out = sparse_attention(query, key, value, topk, self.softmax_scale)
        if learn:
            out = self._sparse_indexer_loss(out, query, key, q_i, w_i, k_i, selected, q_pos, doc_start,
                                            packed_seq_params)
        elif self.probe_recall and self.training and self.computes_topk and topk is not None:
            self._add_stats(0.0, 0, *compute_topk_recall(query.detach(), key.detach(), topk, q_pos, doc_start,
                                                         self.softmax_scale, self.pg_collection.tp,
                                                         self.recall_rows))
        return out.squeeze(1) if thd else out

    def sparse_loss_active(self) -> bool:
        """The sparse-stage indexer loss runs in this forward: a full layer in a training forward with
        grads, outside the warm-up, ``config.dsa_indexer_loss_coeff`` > 0 and a trainable indexer."""
        return (self.computes_topk and self.training and self.warmup_coeff == 0 and torch.is_grad_enabled()
                and (self.config.dsa_indexer_loss_coeff or 0.0) > 0 and indexer_trainable(self.indexer))

    def _sparse_indexer_loss(self, out, query, key, q_i, w_i, k_i, selected, q_pos, doc_start, packed_seq_params):
        """Sparse stage (DeepSeek-V3.2 / GLM-5): Megatron-Core's sparse KL between the main
        attention over each query's selected keys (heads summed) and the indexer's scores there,
        attached to ``out`` with its autoscaler; only the indexer's outputs carry grads (the MLA query
        and key are detached). Adds to ``indexer_stats`` (Σ KL, rows, Σ recall, rows)."""
        from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

        tp = self.pg_collection.tp
        if self._absorbed_inputs:  # the sparse core ran absorbed: score the shared latent rows once for all heads
            (q_abs, lat), self._absorbed_inputs = self._absorbed_inputs, []
            target = compute_sparse_attention_target_latent(q_abs, lat, selected, self.softmax_scale, tp)
        else:
            target = compute_sparse_attention_target(query.detach(), key.detach(), selected, self.softmax_scale, tp)
        b, S = selected.shape[:2]
        valid_rows = dsa_masking.extract_query_valid_rows_from_packed_seq_params(  # padding rows, if marked
            packed_seq_params, b=b, sq=S, device=selected.device)
        loss, kl_sum, rows = compute_sparse_indexer_loss(
            q_i, w_i, k_i, selected, target, float(self.config.dsa_indexer_loss_coeff),
            bool(getattr(self.config, "calculate_per_token_loss", False)), valid_rows)
        recall, n = compute_topk_recall(query.detach(), key.detach(), selected, q_pos, doc_start,
                                        self.softmax_scale, tp, self.recall_rows)
        self._add_stats(kl_sum, rows, recall, n)
        return DSAIndexerLossAutoScaler.apply(out, loss)

    def _add_stats(self, kl_sum, rows: int, recall_sum, recall_rows: int) -> None:
        """Sums may be 0-dim tensors (no device sync here; ``indexer_metrics`` reads them once a step)."""
        st = self.indexer_stats
        st[0] += kl_sum
        st[1] += rows
        st[2] += recall_sum
        st[3] += recall_rows

    def _warmup_indexer_loss(self, out, query, key, x, qr, packed_seq_params, reorder, q_pos, doc_start):
        """Indexer warm-up (DeepSeek-V3.2 dense stage): Megatron-Core's KL loss between the head-summed
        dense attention distribution and the indexer's, attached to ``out`` with its autoscaler so
        only the indexer gets gradients (its inputs are detached). Records the top-k recall of the
        dense attention mass (``indexer_stats``)."""
        from megatron.core.transformer.experimental_attention_variant.dsa import (
            DSAIndexerLossAutoScaler, compute_dsa_indexer_loss)

        q_i, k_i, w_i = self.indexer.forward_before_topk(x.detach(), qr.detach(), packed_seq_params)
        k_i = self._gather_cp(k_i, reorder)
        relu = torch.relu(torch.einsum("sbnd,tbd->bsnt", q_i.float(), k_i.float()))
        scores = torch.einsum("sbn,bsnt->bst", w_i.float(), relu)  # [b, S, T]
        T = k_i.shape[0]
        key_pos = torch.arange(T, device=scores.device)
        allowed = allowed_keys(key_pos, q_pos, doc_start)  # [S, T]
        K = min(self.index_topk, T)
        with torch.no_grad():
            topk = torch.stack([deterministic_topk(scores[bi].masked_fill(~allowed, float("-inf")), K)
                                for bi in range(scores.shape[0])])
        loss = compute_dsa_indexer_loss(
            scores, topk.clamp(min=0), query.float(), key.float(), self.softmax_scale, self.warmup_coeff,
            sparse_loss=False, pg_collection=self.pg_collection,
            varlen_starts=doc_start, varlen_ends=q_pos + 1, key_positions=key_pos,
            calculate_per_token_loss=bool(getattr(self.config, "calculate_per_token_loss", False)))
        with torch.no_grad():  # recall: dense attention mass (summed over heads) inside the top-k set
            att = torch.einsum("sbnh,tbnh->bnst", query.float(), key.float()) * self.softmax_scale
            att = att.masked_fill(~allowed, float("-inf")).softmax(-1).sum(1)
            att = att / att.sum(-1, keepdim=True)
            mass = att.gather(-1, topk.clamp(min=0)).masked_fill(topk < 0, 0.0).sum(-1)  # [b, S]
            rows = allowed.sum(-1) > K  # rows where the top-k is a real choice
        per_token = bool(getattr(self.config, "calculate_per_token_loss", False))
        n_rows = topk.shape[0] * topk.shape[1]
        kl_sum = loss.detach() / self.warmup_coeff * (1 if per_token else n_rows)
        self._add_stats(kl_sum, n_rows, mass[:, rows].sum(), int(rows.sum()) * mass.shape[0])
        return DSAIndexerLossAutoScaler.apply(out, loss)

    def _absorbed(self, query, key, latent, topk, reorder, v_out: int):
        """Sparse attention over the shared latent (see ``absorbed_sparse_attention``); the kv_up
        weight includes an active LoRA adapter's delta, as the unabsorbed path would apply it."""
        from megatron.core.utils import get_pg_size as _size

        cfg = self.config
        dn, dv = cfg.qk_head_dim, cfg.v_head_dim
        if latent.dim() == 2:  # THD
            latent = latent.unsqueeze(1)
        if cfg.sequence_parallel and _size(self.pg_collection.tp) > 1:
            latent = gather_from_sequence_parallel_region(latent, group=self.pg_collection.tp)
        latent = self._gather_cp(latent, reorder)
        kv_up = self._kv_up[0]
        w = kv_up.weight
        lora = getattr(kv_up, "lora", None)
        adapter = lora.applied() if lora is not None else None
        if adapter is not None:
            w = w + lora.local_delta_weight(adapter).to(w.dtype)
        out = absorbed_sparse_attention(query, key[:, :, 0, dn:], latent, w, topk, self.softmax_scale, dn, dv,
                                        stash=self._absorbed_inputs if self.sparse_loss_active() else None)
        if v_out > dv:  # MLA padded the value heads (THD) and trims the padding from our output
            S, b, n = query.shape[:3]
            out = F.pad(out.view(S, b, n, dv), [0, v_out - dv]).view(S, b, n * v_out)
        return out


def link_index_share(modules) -> None:
    """Point every IndexShare core at the nearest earlier full core (iteration order = layer order).

    Raises if a shared layer has no earlier full layer on this pipeline stage.
    """
    last_full = None
    for m in modules:
        if not isinstance(m, GLM5SparseAttention):
            continue
        if m.computes_topk:
            last_full = m
        elif last_full is None:
            raise ValueError(f"layer {m.layer_number}: IndexShare layer has no earlier full DSA layer "
                             "on this pipeline stage")
        else:
            m._topk_source = [last_full]


def link_absorbed_mla(model: torch.nn.Module) -> int:
    """Let every DSA core compute sparse attention in the absorbed form: it captures its MLA's
    normalised kv latent (a forward hook on ``kv_layernorm``) and reads ``linear_kv_up_proj``.
    Skipped where the norm is fused into the up projection (Transformer Engine's
    LayerNorm-linear), which leaves no normalised latent to capture. Returns #linked cores."""
    from megatron.core.transformer.identity_op import IdentityOp

    n = 0
    for attn in model.modules():
        core = getattr(attn, "core_attention", None)
        kv_up, norm = getattr(attn, "linear_kv_up_proj", None), getattr(attn, "kv_layernorm", None)
        if not isinstance(core, GLM5SparseAttention) or kv_up is None or norm is None:
            continue
        if isinstance(norm, IdentityOp) or getattr(kv_up, "layer_norm_weight", None) is not None:
            continue
        core._kv_up = [kv_up]  # a list: not registered as a submodule of the core

        def stash(_mod, _inp, out, core=core):
            core._latent = out

        norm.register_forward_hook(stash)
        n += 1
    return n


def set_indexer_warmup(model: torch.nn.Module, coeff: float) -> int:
    """Indexer warm-up on (``coeff`` > 0) or off: in training forwards every full DSA layer attends
    densely and adds ``coeff`` × the KL indexer loss. Returns #layers."""
    n = 0
    for m in model.modules():
        if isinstance(m, GLM5SparseAttention) and m.computes_topk:
            m.warmup_coeff = float(coeff)
            n += 1
    return n


def indexer_metrics(model: torch.nn.Module, group=None) -> dict[str, float]:
    """``indexer/loss`` (mean KL per query row, before the coefficient) and ``indexer/recall`` (mean
    share of dense attention mass inside the top-k, on the sampled rows where K is a real choice)
    over every layer and row of the training forwards since the last call (warm-up or sparse stage),
    summed over the ranks of ``group`` (default: all; a collective every rank must call — TP copies
    count twice on both sides of each ratio). {} when no indexer loss ran."""
    import torch.distributed as dist

    tot = torch.zeros(4, dtype=torch.float64)
    for m in model.modules():
        if isinstance(m, GLM5SparseAttention):
            tot += torch.stack([torch.as_tensor(v).detach().to("cpu", torch.float64) for v in m.indexer_stats])
            m.indexer_stats = [0.0, 0, 0.0, 0]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        from glm5_mcore.device import training_device

        tot = tot.to(training_device())  # NCCL reduces device tensors only
        dist.all_reduce(tot, group=group)
        tot = tot.cpu()
    out = {}
    if tot[1] > 0:
        out["indexer/loss"] = float(tot[0] / tot[1])
    if tot[3] > 0:
        out["indexer/recall"] = float(tot[2] / tot[3])
    return out


def set_recall_probe(model: torch.nn.Module, on: bool = True) -> int:
    """Measure ``indexer/recall`` in every training forward of a full DSA layer, also where no indexer
    loss runs (a frozen indexer: shows how far the model's attention drifts from its top-k), at the
    cost of ``recall_rows`` dense attention rows per layer. Returns #layers."""
    n = 0
    for m in model.modules():
        if isinstance(m, GLM5SparseAttention) and m.computes_topk:
            m.probe_recall = bool(on)
            n += 1
    return n


def check_indexer_learns(model: torch.nn.Module, setting: str = "train.indexer_loss_coeff") -> None:
    """Refuse an indexer that takes gradients with no loss to give it any: the LM loss never reaches
    it (its top-k is not differentiable), so without the warm-up or sparse-stage loss it would be a
    silent no-op. Raises ValueError naming ``setting``."""
    for m in model.modules():
        if not (isinstance(m, GLM5SparseAttention) and indexer_trainable(m.indexer)):
            continue
        if m.warmup_coeff > 0 or (m.config.dsa_indexer_loss_coeff or 0.0) > 0:
            continue
        raise ValueError(f"{setting}: layer {m.layer_number}'s DSA indexer requires gradients but no indexer loss "
                         "reaches it (the LM loss does not); set the indexer loss coefficient > 0 or freeze "
                         "the indexer")


def set_indexer_frozen(model: torch.nn.Module, frozen: bool = True) -> int:
    """Freeze (or unfreeze) every DSA indexer: no grads, hence no optimizer state. Returns #params."""
    count = 0
    for m in model.modules():
        if isinstance(m, GLM5SparseAttention) and m.indexer is not None:
            for p in m.indexer.parameters():
                p.requires_grad_(not frozen)
                count += p.numel()
    return count

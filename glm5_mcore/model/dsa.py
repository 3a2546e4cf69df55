"""GLM-5 DeepSeek Sparse Attention (DSA) as a Megatron-Core MLA ``core_attention``.

The lightning indexer is Megatron-Core's own ``DSAIndexer`` (wq_b on the q latent, wk + LayerNorm,
weights_proj, partial interleaved RoPE on the first ``qk_pos_emb_head_dim`` dims). This module adds
what GLM-5 training needs around it, on the tensor math of ``glm5_mcore.model.sparse_attention``:

- ``GLM5SparseAttention``: the core attention module: THD packing, allgather context parallel,
  IndexShare (a "shared" layer reuses the previous full layer's top-k), a frozen-indexer switch, and
  the indexer's two training stages: the dense warm-up and the sparse stage
  (``config.dsa_indexer_loss_coeff`` > 0 with a trainable indexer: Megatron-Core's sparse KL over the
  selected keys, ``glm5_mcore.model.indexer_loss``), each attached with ``DSAIndexerLossAutoScaler``.
  The model-wide switches are in ``glm5_mcore.model.indexer_stages``.
- ``link_index_share`` / ``link_absorbed_mla``: wire the cores of a built model together.

Legend: S query rows, T key rows, b batch, n heads, h head dim, K top-k, C query-chunk rows.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.experimental_attention_variant import dsa_indexer_loss, dsa_layout, dsa_masking
from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler, DSAttentionSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import build_module
from megatron.core.utils import get_pg_size
from torch.utils.weak import WeakIdKeyDictionary


from glm5_mcore.model.cp_positions import packed_cp_positions
from glm5_mcore.model.dsa_backend import active as fused_active, check as check_fused
from glm5_mcore.model.dsa_backend import fused_core, fused_topk, fused_topk_with_loss, notice as fused_notice
from glm5_mcore.model.indexer_loss import (DenseIndexerKL, compute_sparse_attention_target,
                                           compute_sparse_attention_target_latent, compute_sparse_indexer_loss,
                                           compute_topk_recall, indexer_trainable)
from glm5_mcore.model.sparse_attention import (CHUNK_BYTES, absorbed_query, compute_index_topk, dense_attention,
                                               latent_attention, sparse_attention)
from glm5_mcore.switches import switched


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
        """This forward's top-k [b, S, K], held after it only where something reads it: inside
        ``keeping_topk`` (parity, RL's top-k agreement), or on a full layer IndexShare layers read
        (``feeds_sharers``) in a forward without THD packing (no micro-batch to key it by). Elsewhere None:
        held on every layer it would outlive the backward (under full recompute, s·K·8 bytes per layer)."""
        self._topk_for_sharers = WeakIdKeyDictionary()
        """On a full layer IndexShare layers read: a micro-batch's ``packed_seq_params`` → its top-k, for the
        sharers' forward and recompute (under 1F1B not of the last micro-batch this layer saw); it lives as
        long as that ``PackedSeqParams`` (a recompute closure holds it until its backward)."""
        self.feeds_sharers = False
        self.keep_topk = False
        self._latent: Optional[torch.Tensor] = None  # kv_layernorm output of this forward (absorbed path)
        self.warmup_coeff = 0.0  # > 0: indexer warm-up (dense attention + KL indexer loss), set_indexer_warmup
        if (config.dsa_indexer_loss_coeff or 0.0) > 0 and not config.dsa_indexer_use_sparse_loss:
            raise ValueError("dsa_indexer_loss_coeff > 0 with dsa_indexer_use_sparse_loss=False (a dense KL "
                             "while attending sparsely) is not supported: the dense form is the indexer "
                             "warm-up stage (set_indexer_warmup)")
        self.recall_rows = 128  # query rows per forward sampled for the top-k recall metric
        self.probe_recall = False  # measure the recall in training forwards without the loss too
        self.indexer_stats = [0.0, 0, 0.0, 0]  # Σ KL, #rows, Σ recall, #rows since indexer_metrics read them
        self._kv_up: list = []  # [the parent MLA's linear_kv_up_proj], set by link_absorbed_mla
        self.fused = fused_active(config)  # Megatron-Core's fused kernels (config.dsa_kernel_backend)
        if self.fused:
            check_fused(config, get_pg_size(pg_collection.tp),
                        trains_indexer=computes_topk and (config.dsa_indexer_loss_coeff or 0.0) > 0)
            fused_notice(config)

    def _positions(self, sq: int, device, packed_seq_params: Optional[PackedSeqParams]):
        """Each query's index in the (CP-gathered) key order and its document's first key."""
        cp_group = self.pg_collection.cp
        cp, rank = get_pg_size(cp_group), (cp_group.rank() if get_pg_size(cp_group) > 1 else 0)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            cu_q, cu_kv = dsa_layout.get_packed_qk_cu_seqlens(packed_seq_params)
            cu_q = cu_q.to(device=device, dtype=torch.int64)
            q_pos, reorder = packed_cp_positions(cu_q, cu_kv.to(device), cp, rank, sq)  # no host read (cp_positions)
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
        qr [S',b,r_q] (S' = S/TP under sequence parallel). Returns [S, b, n·hv] (THD: [t, n·hv]).

        No host read of a device tensor (no ``.item()``, ``int()``, ``bool()``, ``nonzero``): every
        branch depends on shapes and settings only. Under context parallelism the absorbed core
        all-gathers the 576-wide latent row (kv latent ⊕ rope key), not per-head keys and values."""
        thd = query.dim() == 3
        if thd:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
        sq = query.shape[0]
        q_pos, doc_start, reorder = self._positions(sq, query.device, packed_seq_params)
        natural = reorder is None  # no CP: query i sits at key position i
        plain_causal = natural and packed_seq_params is None
        skv = sq * get_pg_size(self.pg_collection.cp) if reorder is not None else key.shape[0]
        latent, self._latent = self._latent, None

        if self.warmup_coeff > 0 and self.computes_topk and self.training:  # dense, and so its sharers
            self.last_topk = None
            if self.feeds_sharers and packed_seq_params is not None:
                self._topk_for_sharers[packed_seq_params] = None
            key, value = self._gather_cp(key, reorder), self._gather_cp(value, reorder)
            out = dense_attention(query, key, value, q_pos, doc_start, self.softmax_scale, plain_causal)
            out = self._warmup_indexer_loss(out, query, key, x, qr, packed_seq_params, reorder, q_pos, doc_start)
            return out.squeeze(1) if thd else out
        absorbed = bool(self._kv_up) and latent is not None and self.index_topk < skv and self._absorbable()
        if absorbed:  # the absorbed query and the shared latent rows [T, b, 576], gathered once over CP
            q_cat, lat, w = self._absorbed_inputs(query, key, latent, reorder)
        else:
            key, value = self._gather_cp(key, reorder), self._gather_cp(value, reorder)
        learn = self.sparse_loss_active()
        loss = None
        if self.computes_topk and (learn or self.index_topk < skv):
            grad = torch.enable_grad() if learn else torch.no_grad()
            with grad:  # sparse stage: the indexer's outputs keep their graph (its inputs are detached)
                q_i, k_i, w_i = self.indexer.forward_before_topk(x.detach(), qr.detach(), packed_seq_params)
                k_i = self._gather_cp(k_i, reorder)
            topk, loss = self._select(q_i, k_i, w_i, q_pos, doc_start, natural, learn,
                                      (q_cat, lat) if absorbed else None, packed_seq_params)
            if not learn:  # the indexer's outputs (q_i: s·32·128 bf16) die before the sparse core runs
                q_i = k_i = w_i = None
        elif self.computes_topk:
            topk = None
        else:
            topk = self._shared_topk(packed_seq_params)
        selected = topk
        if self.index_topk >= skv:
            topk = None
        self.last_topk = topk if self.keep_topk or (self.feeds_sharers and packed_seq_params is None) else None
        if self.feeds_sharers and packed_seq_params is not None:
            self._topk_for_sharers[packed_seq_params] = topk

        if topk is None:
            out = dense_attention(query, key, value, q_pos, doc_start, self.softmax_scale, plain_causal)
        elif absorbed:
            out = latent_attention(q_cat, lat, w, topk, self.softmax_scale, self.config.qk_head_dim,
                                   self.config.v_head_dim, fused_core(self.config) if self.fused else None)
            v_out = value.shape[-1]
            if v_out > self.config.v_head_dim:  # MLA padded the value heads (THD) and trims the padding from our output
                S, b, n = query.shape[:3]
                out = F.pad(out.view(S, b, n, -1), [0, v_out - self.config.v_head_dim]).view(S, b, n * v_out)
        else:
            out = sparse_attention(query, key, value, topk, self.softmax_scale)
        probe = self.probe_recall and self.training and self.computes_topk and selected is not None
        if learn and loss is None:
            loss = self._sparse_indexer_loss(query, key, q_i, w_i, k_i, selected,
                                             (q_cat, lat) if absorbed else None, packed_seq_params)
        if learn or probe:
            qq, kk = (q_cat.detach(), lat.detach().unsqueeze(2)) if absorbed else (query.detach(), key.detach())
            recall, n = compute_topk_recall(qq, kk, selected, q_pos, doc_start, self.softmax_scale,
                                            self.pg_collection.tp, self.recall_rows)
            self._add_stats(0.0, 0, recall, n)
        if loss is not None:
            out = DSAIndexerLossAutoScaler.apply(out, loss)
        return out.squeeze(1) if thd else out

    def _shared_topk(self, packed_seq_params: Optional[PackedSeqParams]) -> Optional[torch.Tensor]:
        """An IndexShare layer's top-k [b, S, K] (None: dense): its source's for this micro-batch, in the
        forward and any recompute. Without THD packing (no key) the source's last forward, which a recompute
        under pipeline parallelism would take from a later micro-batch: refused there."""
        if not self._topk_source:
            raise RuntimeError(f"layer {self.layer_number}: IndexShare layer not linked to a full layer")
        src, cfg = self._topk_source[0], self.config
        if packed_seq_params is None:
            if cfg.recompute_granularity is not None and (cfg.pipeline_model_parallel_size or 1) > 1:
                raise RuntimeError(f"layer {self.layer_number}: IndexShare under recompute with pipeline "
                                   "parallelism needs THD packed_seq_params (the key of its source's top-k)")
            return src.last_topk
        if packed_seq_params not in src._topk_for_sharers:
            raise RuntimeError(f"layer {self.layer_number}: IndexShare layer ran a micro-batch its source layer "
                               f"{src.layer_number} has not")
        return src._topk_for_sharers[packed_seq_params]

    def _absorbable(self) -> bool:
        """Whether this forward may take the absorbed core. Not under selective core-attention recompute,
        eval too (Megatron's replay, attention.py ``_checkpointed_attention_forward``, sees q/k/v/x/qr but not
        the latent the ``kv_layernorm`` hook caught, so training takes the unabsorbed core; RL's old log-probs
        take the one its update does), nor in training with LoRA dropout on ``linear_kv_up_proj`` (one
        absorbed weight cannot drop its input)."""
        cfg = self.config
        if cfg.recompute_granularity == "selective" and "core_attn" in (cfg.recompute_modules or []):
            return False
        if not self.training:
            return True
        lora = getattr(self._kv_up[0], "lora", None)
        name = lora.applied() if lora is not None else None
        return name is None or not lora.dropout.get(name, 0.0) > 0

    def sparse_loss_active(self) -> bool:
        """The sparse-stage indexer loss runs in this forward: a full layer in a training forward with
        grads, outside the warm-up, ``config.dsa_indexer_loss_coeff`` > 0 and a trainable indexer."""
        return (self.computes_topk and self.training and self.warmup_coeff == 0 and torch.is_grad_enabled()
                and (self.config.dsa_indexer_loss_coeff or 0.0) > 0 and indexer_trainable(self.indexer))

    def _select(self, q_i, k_i, w_i, q_pos, doc_start, natural, learn, absorbed, packed_seq_params):
        """(top-k [b, S, K], the fused backend's sparse-stage loss or None). On the fused path
        Megatron-Core's hooks score and select (and, in the sparse stage with the absorbed core, add the
        KL); elsewhere ``compute_index_topk``."""
        if self.fused:
            coeff = float(self.config.dsa_indexer_loss_coeff or 0.0)
            if learn and absorbed is not None:
                q_cat, lat = absorbed
                res = fused_topk_with_loss(
                    self.config, q_i, k_i, w_i, self.index_topk, doc_start, q_pos + 1, CHUNK_BYTES, q_cat,
                    lat.unsqueeze(2), self.softmax_scale, coeff, self.pg_collection, self._valid_rows(q_i,
                                                                                                    packed_seq_params))
                if res is not None:
                    topk, loss = res
                    b, S = topk.shape[:2]
                    per_token = bool(getattr(self.config, "calculate_per_token_loss", False))
                    self._add_stats(loss.detach() / coeff * (1 if per_token else b * S), b * S, 0.0, 0)
                    return topk, loss
            with torch.no_grad():
                topk = fused_topk(self.config, q_i, k_i, w_i, self.index_topk, doc_start, q_pos + 1,
                                              CHUNK_BYTES)
            if topk is not None:
                return topk, None
        return compute_index_topk(q_i.detach(), k_i.detach(), w_i.detach(), self.index_topk, q_pos, doc_start,
                                  natural), None

    def _valid_rows(self, q_i, packed_seq_params):
        return dsa_masking.extract_query_valid_rows_from_packed_seq_params(  # padding rows, if marked
            packed_seq_params, b=q_i.shape[1], sq=q_i.shape[0], device=q_i.device)

    def _sparse_indexer_loss(self, query, key, q_i, w_i, k_i, selected, absorbed, packed_seq_params):
        """Sparse stage (DeepSeek-V3.2 / GLM-5): Megatron-Core's sparse KL between the main
        attention over each query's selected keys (heads summed) and the indexer's scores there,
        returned for ``DSAIndexerLossAutoScaler``; only the indexer's outputs carry grads (the MLA query
        and key are detached). Adds (Σ KL, rows) to ``indexer_stats``."""
        tp = self.pg_collection.tp
        if absorbed is not None:  # the sparse core ran absorbed: score the shared latent rows once for all heads
            q_cat, lat = absorbed
            b, S = selected.shape[:2]
            target = compute_sparse_attention_target_latent(q_cat.transpose(0, 1).reshape(b * S, *q_cat.shape[2:]),
                                                            lat.transpose(0, 1).reshape(-1, lat.shape[-1]),
                                                            selected, self.softmax_scale, tp)
        else:
            target = compute_sparse_attention_target(query.detach(), key.detach(), selected, self.softmax_scale, tp)
        loss, kl_sum, rows = compute_sparse_indexer_loss(
            q_i, w_i, k_i, selected, target, float(self.config.dsa_indexer_loss_coeff),
            bool(getattr(self.config, "calculate_per_token_loss", False)), self._valid_rows(q_i, packed_seq_params))
        self._add_stats(kl_sum, rows, 0.0, 0)
        return loss

    def _add_stats(self, kl_sum, rows, recall_sum, recall_rows) -> None:
        """Sums and counts may be 0-dim tensors (no device sync here; ``indexer_metrics`` reads them once a step)."""
        st = self.indexer_stats
        st[0] += kl_sum
        st[1] += rows
        st[2] += recall_sum
        st[3] += recall_rows

    def _warmup_indexer_loss(self, out, query, key, x, qr, packed_seq_params, reorder, q_pos, doc_start):
        """Indexer warm-up (DeepSeek-V3.2 dense stage): Megatron-Core's dense KL loss between the
        head-summed attention distribution and the indexer's, chunked by query rows
        (``DenseIndexerKL``: never a [T, T] tensor), attached to ``out`` with its autoscaler so only the
        indexer gets gradients (its inputs are detached). Records the top-k recall of the dense
        attention mass (``indexer_stats``)."""
        q_i, k_i, w_i = self.indexer.forward_before_topk(x.detach(), qr.detach(), packed_seq_params)
        k_i = self._gather_cp(k_i, reorder)
        kl_sum, mass, rows = DenseIndexerKL.apply(q_i, w_i, k_i, query.detach(), key.detach(), q_pos, doc_start,
                                                  self.softmax_scale, self.index_topk, self.pg_collection.tp)
        b, S = q_i.shape[1], q_i.shape[0]
        per_token = bool(getattr(self.config, "calculate_per_token_loss", False))
        loss = self.warmup_coeff * dsa_indexer_loss.reduce_indexer_kl_sum(
            kl_sum, num_rows=b * S, calculate_per_token_loss=per_token)
        self._add_stats(kl_sum.detach(), b * S, mass, rows)
        return DSAIndexerLossAutoScaler.apply(out, loss)

    def _absorbed_inputs(self, query, key, latent, reorder):
        """(absorbed query [S, b, n, 576], latent rows [T, b, 576] gathered over SP and CP, kv_up weight):
        the kv_up weight includes an active LoRA adapter's delta, as the unabsorbed path would apply it.
        Only the 576-wide latent ⊕ rope key travels over CP (not the n·(192 + 256)-wide keys and values)."""
        cfg = self.config
        dn, dv = cfg.qk_head_dim, cfg.v_head_dim
        if latent.dim() == 2:  # THD
            latent = latent.unsqueeze(1)
        if cfg.sequence_parallel and get_pg_size(self.pg_collection.tp) > 1:
            latent = gather_from_sequence_parallel_region(latent, group=self.pg_collection.tp)
        lat = torch.cat([latent, key[:, :, 0, dn:].to(latent.dtype)], dim=-1)  # [S, b, dc + dr]
        lat = self._gather_cp(lat, reorder)
        kv_up = self._kv_up[0]
        w = kv_up.weight
        lora = getattr(kv_up, "lora", None)
        adapter = lora.applied() if lora is not None else None
        if adapter is not None:
            w = w + lora.local_delta_weight(adapter).to(w.dtype)
        return absorbed_query(query, w, dn, dv), lat, w


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
            last_full.feeds_sharers = True


@contextlib.contextmanager
def keeping_topk(model: torch.nn.Module):
    """Inside the block every DSA core of ``model`` holds ``last_topk`` after its forward, for a reader
    inside the block after the forward (parity's per-layer top-k, RL's trainer/engine top-k
    agreement); on leaving, the cores that hold it for no IndexShare layer drop it."""
    cores = [m for m in model.modules() if isinstance(m, GLM5SparseAttention)]
    try:
        with switched(cores, "keep_topk", True):
            yield
    finally:
        for m in cores:
            if not (m.keep_topk or m.feeds_sharers):
                m.last_topk = None


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

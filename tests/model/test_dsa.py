"""The sparse attention core and the deterministic top-k against plain references."""

import torch

from glm5_mcore.model.sparse_attention import compute_index_topk, deterministic_topk, sparse_attention


def test_deterministic_topk_breaks_ties_to_lower_index():
    s = torch.tensor([[0.0, 1.0, 0.0, 1.0, 0.0, float("-inf")]])
    assert deterministic_topk(s, 3).tolist() == [[0, 1, 3]]
    assert sorted(deterministic_topk(s, 6).tolist()[0]) == [-1, 0, 1, 2, 3, 4]


def test_deterministic_topk_is_the_stable_sort_set():
    g = torch.Generator().manual_seed(0)
    s = torch.randint(0, 4, (64, 200), generator=g).float()  # heavy ties
    s[:, 150:] = float("-inf")
    s[:3] = float("-inf")
    for k in (1, 7, 64, 180):
        ref = torch.sort(s, dim=-1, descending=True, stable=True)
        ref_idx = ref.indices[:, :k].masked_fill(ref.values[:, :k] == float("-inf"), -1)
        got = deterministic_topk(s, k)
        assert torch.equal(got.sort(-1).values, ref_idx.sort(-1).values), k


def _dense_reference(q, k, v, topk, scale):
    S, b, n, _ = q.shape
    T = k.shape[0]
    allowed = torch.zeros(b, S, T, dtype=torch.bool)
    for bi in range(b):
        for s in range(S):
            sel = topk[bi, s][topk[bi, s] >= 0]
            allowed[bi, s, sel] = True
    scores = torch.einsum("sbnh,tbnh->bnst", q, k) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    out = torch.einsum("bnst,tbnh->sbnh", scores.softmax(-1), v)
    return out.reshape(S, b, -1)


def test_sparse_core_matches_masked_dense_forward_and_backward():
    g = torch.Generator().manual_seed(0)
    S, b, n, h, hv, K = 40, 2, 3, 12, 8, 7
    q, k = (torch.randn(S, b, n, h, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(S, b, n, hv, generator=g, requires_grad=True)
    iq = torch.randn(S, b, 4, 6, generator=g)
    ik = torch.randn(S, b, 6, generator=g)
    w = torch.randn(S, b, 4, generator=g)
    pos = torch.arange(S)
    topk = compute_index_topk(iq, ik, w, K, pos, torch.zeros_like(pos))
    assert (topk[:, K - 1:] >= 0).all() and (topk[:, :K - 1] == -1).any()
    out = sparse_attention(q, k, v, topk, 0.3)
    ref = _dense_reference(q, k, v, topk, 0.3)
    assert (out - ref).abs().max() < 1e-5
    go = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), go)
    ref_grads = torch.autograd.grad(ref, (q, k, v), go)
    for a, r in zip(grads, ref_grads):
        assert (a - r).abs().max() < 1e-5


def test_topk_respects_causal_and_document_bounds():
    g = torch.Generator().manual_seed(1)
    S = 30
    pos = torch.arange(S)
    doc_start = torch.tensor([0] * 10 + [10] * 20)
    topk = compute_index_topk(torch.randn(S, 1, 4, 6, generator=g), torch.randn(S, 1, 6, generator=g),
                              torch.rand(S, 1, 4, generator=g), 5, pos, doc_start)
    for s in range(S):
        sel = topk[0, s][topk[0, s] >= 0]
        assert (sel <= s).all() and (sel >= doc_start[s]).all()
        assert len(sel) == min(5, s - int(doc_start[s]) + 1)


def test_absorbed_sparse_attention_equals_expanded_keys_values():
    from glm5_mcore.model.sparse_attention import absorbed_sparse_attention, sparse_attention

    g = torch.Generator().manual_seed(0)
    S, b, n, dn, dr, dv, dc, K = 24, 2, 3, 8, 4, 6, 10, 5
    q = torch.randn(S, b, n, dn + dr, generator=g, requires_grad=True)
    c = torch.randn(S, b, dc, generator=g, requires_grad=True)
    kr = torch.randn(S, b, dr, generator=g, requires_grad=True)
    w = torch.randn(n * (dn + dv), dc, generator=g, requires_grad=True)
    scores = torch.randn(b, S, S, generator=g).masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    topk = torch.stack([deterministic_topk(scores[i], K) for i in range(b)])
    kv = torch.einsum("tbc,oc->tbo", c, w).view(S, b, n, dn + dv)
    key = torch.cat([kv[..., :dn], kr[:, :, None].expand(-1, -1, n, -1)], -1)
    ref = sparse_attention(q, key, kv[..., dn:], topk, 0.3)
    got = absorbed_sparse_attention(q, torch.cat([c, kr], -1), w, topk, 0.3, dn, dv)
    assert (got - ref).abs().max() <= 1e-5
    gr = torch.autograd.grad(ref.square().sum(), (q, c, kr, w))
    gg = torch.autograd.grad(got.square().sum(), (q, c, kr, w))
    for a, bb in zip(gr, gg):
        assert (a - bb).abs().max() <= 1e-4 * (1 + a.abs().max())


def test_model_absorbed_path_matches_unabsorbed_and_takes_kv_up_lora(tiny_dir, single_rank):
    from glm5_mcore.config import GLM5Config
    from glm5_mcore.mcore_settings import ParallelConfig
    from glm5_mcore.model.dsa import GLM5SparseAttention
    from glm5_mcore.lora.config import LoRAConfig
    from glm5_mcore.lora.apply import apply_lora
    from glm5_mcore.model.build import build_model, forward_logits
    from glm5_mcore.checkpoint.hf_load import load_hf_weights

    glm5 = GLM5Config.from_hf_dir(tiny_dir)
    m = build_model(glm5, ParallelConfig())
    load_hf_weights(m, tiny_dir, glm5)
    cores = [x for x in m.modules() if isinstance(x, GLM5SparseAttention)]
    assert cores and all(x._kv_up for x in cores)
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(2))

    def run(absorbed: bool):
        saved = [x._kv_up for x in cores]
        if not absorbed:
            for x in cores:
                x._kv_up = []
        m.zero_grad(set_to_none=True)
        out = forward_logits(m, ids)
        out.square().mean().backward()
        for x, s in zip(cores, saved):
            x._kv_up = s
        grads = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
        return out.detach(), grads

    base_a, ga = run(True)
    base_p, gp = run(False)
    assert (base_a - base_p).abs().max() <= 1e-5
    assert ga.keys() == gp.keys() and all((ga[k] - gp[k]).abs().max() <= 1e-4 * (1 + gp[k].abs().max()) for k in ga)
    apply_lora(m, LoRAConfig(rank=4, targets=("linear_kv_up_proj",), init="random"))
    lora_a, ga = run(True)
    lora_p, gp = run(False)
    assert (lora_a - base_a).abs().max() > 1e-3  # the adapter changes the absorbed path...
    assert (lora_a - lora_p).abs().max() <= 1e-5  # ...exactly as it changes the plain one
    lora_grads = [k for k in ga if ".lora." in k]
    assert lora_grads and all((ga[k] - gp[k]).abs().max() <= 1e-4 * (1 + gp[k].abs().max()) for k in lora_grads)


def test_dense_attention_per_document_equals_masked():
    from glm5_mcore.model.sparse_attention import dense_attention

    g = torch.Generator().manual_seed(1)
    S, b, n, h = 20, 1, 2, 8
    q, k, v = (torch.randn(S, b, n, h, generator=g) for _ in range(3))
    doc_start = torch.tensor([0] * 7 + [7] * 9 + [16] * 4)
    pos = torch.arange(S)
    got = dense_attention(q, k, v, pos, doc_start, 0.3)  # one SDPA per document
    key_pos = torch.arange(S)
    mask = (key_pos[None] <= pos[:, None]) & (key_pos[None] >= doc_start[:, None])
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), attn_mask=mask, scale=0.3)
    ref = ref.permute(2, 0, 1, 3).reshape(S, b, -1)
    assert (got - ref).abs().max() <= 1e-6


def test_last_topk_held_only_for_its_readers(single_rank):
    """A DSA core's [b, S, K] top-k outlives the forward only where it is read: on a full layer an
    IndexShare layer reads (pattern FFSF: layer 1 feeds layer 2), or inside ``keeping_topk``
    (parity, RL's top-k agreement). Held on every layer it would be s·K·8 bytes per layer past the
    backward, unplanned under full recompute."""
    from glm5_mcore.config import glm5_tiny
    from glm5_mcore.mcore_settings import ParallelConfig
    from glm5_mcore.model.build import build_model, forward_logits
    from glm5_mcore.model.dsa import GLM5SparseAttention, keeping_topk

    m = build_model(glm5_tiny(index_share=True), ParallelConfig())
    cores = [x for x in m.modules() if isinstance(x, GLM5SparseAttention)]
    assert [c.computes_topk for c in cores] == [True, True, False, True]
    ids = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(0))  # 32 tokens > top-k 8
    forward_logits(m, ids).square().mean().backward()
    assert [c.last_topk is not None for c in cores] == [False, True, False, False]
    with torch.no_grad(), keeping_topk(m):
        forward_logits(m, ids)
        held = [c.last_topk for c in cores]
        assert all(t is not None and t.shape == (1, 32, 8) for t in held)
        assert held[2] is held[1]  # the IndexShare layer's is its source's
    assert [c.last_topk is not None for c in cores] == [False, True, False, False]


def test_index_share_recompute_reads_its_own_micro_batch_topk(tiny_share_pp_dir, single_rank):
    """Full and selective recompute, 1F1B's order on one rank (forward 0, forward 1, backward 0, backward 1):
    the IndexShare layer's recompute in backward 0 takes micro-batch 0's top-k, so the adapter gradients
    equal forward + backward of each in turn without recompute (exactly; LoRA dropout drawn and replayed,
    on ``linear_kv_up_proj`` too, which keeps every mode on the unabsorbed core); the kept top-k lives as long as its micro-batch's
    ``PackedSeqParams``: micro-batch 0's goes with its backward, none is kept without recompute (under
    selective recompute the last one's outlives its backward until the next forward: Megatron's allgather
    dispatcher keeps ``local_probs``, token_dispatcher.py:328, whose graph reaches the attention checkpoint).
    Was: read from the source layer's last forward, micro-batch 1's (gradients 0.99 of their size apart under
    PP 2, ``tests/layouts``)."""
    from glm5_mcore.lora.apply import apply_lora
    from glm5_mcore.lora.config import MLA, LoRAConfig
    from glm5_mcore.mcore_settings import recompute_overrides
    from glm5_mcore.model.build import packed_seq_params_from_lengths
    from glm5_mcore.model.dsa import GLM5SparseAttention
    from tests.support.helpers import hf_model

    g = torch.Generator().manual_seed(0)
    micro = [(torch.randint(3, 128, (1, 33), generator=g), lengths) for lengths in ([20, 12], [9, 23])]

    def forward(m, ids, lengths):
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        return m(ids[:, :-1], pos, None, labels=ids[:, 1:],
                 packed_seq_params=packed_seq_params_from_lengths(lengths)).float().mean()

    def grads(mode, order):
        m, _ = hf_model(tiny_share_pp_dir, **recompute_overrides(mode))
        apply_lora(m, LoRAConfig(rank=4, alpha=8, targets=MLA, init="random", dropout=0.1))
        m.train()
        source = [c for c in m.modules() if isinstance(c, GLM5SparseAttention)][2]  # FSFS: layer 3 feeds 4
        losses, held = {}, []
        for step, i in order:
            if step == "f":
                losses[i] = forward(m, *micro[i])
            else:
                losses.pop(i).backward()
            held.append(len(source._topk_for_sharers))
        return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}, held

    sequential = [("f", 0), ("b", 0), ("f", 1), ("b", 1)]
    one_f_one_b = [("f", 0), ("f", 1), ("b", 0), ("b", 1)]
    ref, held = grads(None, sequential)
    assert held == [0, 0, 0, 0]  # without recompute nothing outlives the forward
    for mode in ("full", "selective"):
        got, held = grads(mode, one_f_one_b)
        assert held[:3] == [1, 2, 1] and held[3] <= 1, (mode, held)
        diff = max(float((got[k] - v).abs().max()) for k, v in ref.items())
        assert sorted(got) == sorted(ref) and diff == 0.0, (mode, diff)


def test_held_topk_is_the_planners(single_rank):
    """The bytes of top-k DSA cores hold after a forward + backward are the planner's ``held_topk``
    under full recompute (where nothing else counts them): FFSF, 32 tokens, top-k 8, int64 = 2 KiB,
    layer 1's, for layer 2 (whose recompute reads it; a forward without THD packing, where no micro-batch
    keys it)."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from glm5_mcore.config import glm5_tiny
    from glm5_mcore.mcore_settings import ParallelConfig
    from glm5_mcore.model.build import build_model, forward_logits
    from glm5_mcore.model.dsa import GLM5SparseAttention
    from glm5_mcore.plan.activations import stage_activations
    from glm5_mcore.plan.layout import Layout

    glm5 = glm5_tiny(index_share=True)
    m = build_model(glm5, ParallelConfig())
    ids = torch.randint(0, 128, (1, 32), generator=torch.Generator().manual_seed(0))
    forward_logits(m, ids).square().mean().backward()
    kept = {StorageWeakRef(c.last_topk.untyped_storage()): c.last_topk.untyped_storage().nbytes()
            for c in m.modules() if isinstance(c, GLM5SparseAttention) and c.last_topk is not None}
    plan = stage_activations(glm5, Layout(world=1), 0, 32, bf16=False, recompute="full", mtp=False,
                             microbatches=1, fused_dsa=False)
    assert sum(kept.values()) == plan.held_topk == 32 * 8 * 8
    assert stage_activations(glm5, Layout(world=1), 0, 32, bf16=False, recompute=None, mtp=False,
                             microbatches=1, fused_dsa=False).held_topk == 0  # saved for backward: counted there

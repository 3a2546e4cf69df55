"""The sparse attention core and the deterministic top-k against plain references."""

import torch

from glm5_mcore.dsa import compute_index_topk, deterministic_topk, sparse_attention


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

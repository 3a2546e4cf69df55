"""The fused CPU DSA kernels against the PyTorch path they replace (and against plain definitions)."""

import contextlib
import os
import shutil
import warnings

import pytest
import torch

from glm5_mcore import kernels
from glm5_mcore.model.sparse_attention import SparseLatentAttention, compute_index_topk, deterministic_topk
from tests.support.helpers import LargestTensor

# only a missing compiler skips: a kernel that fails to build must fail these tests, not hide
pytestmark = pytest.mark.skipif(not (os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")),
                                reason="no C++ compiler: the PyTorch path is the only one")


def _stable_sort_topk(s: torch.Tensor, k: int) -> torch.Tensor:
    ref = torch.sort(s, dim=-1, descending=True, stable=True)
    idx = ref.indices[:, :k].masked_fill(ref.values[:, :k] == float("-inf"), -1)
    return idx.sort(-1).values


def test_topk_rows_is_the_stable_sort_set_and_matches_the_torch_path():
    g = torch.Generator().manual_seed(0)
    cases = 0
    for trial in range(40):
        R, L = 23, int(torch.randint(1, 300, (1,), generator=g))
        if trial % 3 == 0:
            s = torch.randn(R, L, generator=g)
        else:  # heavy ties, at two scales
            s = torch.randint(-3, 4, (R, L), generator=g).float() * (0.5 if trial % 2 else 1e-3)
        s[torch.rand(R, L, generator=g) < 0.2] = float("-inf")
        s[torch.rand(R, L, generator=g) < 0.05] = -0.0  # -0.0 ties with +0.0, as float comparison says
        s[:2] = float("-inf")
        for k in sorted({1, min(5, L), min(64, L), L}):
            got = kernels.topk_rows(s, torch.zeros(R, dtype=torch.int64), torch.full((R,), L), k)
            ref = _stable_sort_topk(s, k)
            assert torch.equal(got.sort(-1).values, ref), (trial, k)
            with kernels.disabled():
                torch_path = deterministic_topk(s, k)
            assert torch.equal(deterministic_topk(s, k), torch_path), (trial, k)  # same order too
            cases += 1
    assert cases > 100


def test_topk_rows_on_long_rows_sampled_threshold_and_its_fallback():
    """Rows of >= 1024 entries (and >= 4k) take a sampled threshold; a row whose sampled entries are
    its largest makes the threshold overshoot and falls back to the full radix select."""
    g = torch.Generator().manual_seed(3)
    R, L = 12, 4096
    s = torch.randint(0, 40, (R, L), generator=g).float()  # heavy ties at the k-th value
    s[1] = torch.randn(L, generator=g)
    s[2, torch.arange(0, L, 16)] = 100.0 + torch.arange(256).float()  # exactly the sampled columns
    s[3, : L // 2] = float("-inf")
    s[4, 7] = float("nan")
    lo, hi = torch.zeros(R, dtype=torch.int64), torch.full((R,), L)
    lo[5], hi[5] = 1000, 3500
    for k in (64, 512, 1000):
        got = kernels.topk_rows(s, lo, hi, k)
        for r in range(R):
            a, b = int(lo[r]), int(hi[r])
            ref = _stable_sort_topk(s[r: r + 1, a:b].nan_to_num(nan=float("-inf")), k)
            ref = torch.where(ref >= 0, ref + a, -1)
            assert torch.equal(got[r: r + 1], ref), (k, r)


def test_topk_rows_never_picks_nan_and_honours_row_ranges():
    s = torch.tensor([[float("nan"), 3.0, 1.0, 2.0, 5.0, 4.0]])
    got = kernels.topk_rows(s, torch.tensor([0]), torch.tensor([6]), 2)
    assert got.tolist() == [[4, 5]]
    got = kernels.topk_rows(s.repeat(2, 1), torch.tensor([1, 0]), torch.tensor([4, 3]), 2, offset=10)
    assert got.tolist() == [[11, 13], [11, 12]]  # row 1: NaN at 0 is never chosen, so 1 and 2
    got = kernels.topk_rows(s, torch.tensor([2]), torch.tensor([4]), 3)
    assert got.tolist() == [[2, 3, -1]]


@pytest.mark.parametrize("threads", [1, 2])
def test_indexer_topk_matches_torch_path_with_documents(threads):
    g = torch.Generator().manual_seed(1)
    S, b, nI, dI, K = 300, 2, 3, 20, 37
    q = torch.randn(S, b, nI, dI, generator=g)
    k = torch.randn(S, b, dI, generator=g)
    w = torch.randn(S, b, nI, generator=g)
    pos = torch.arange(S)
    doc_start = torch.tensor([0] * 40 + [40] * 200 + [240] * 60)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = compute_index_topk(q, k, w, K, pos, doc_start)
    finally:
        torch.set_num_threads(old)
    with kernels.disabled():
        ref = compute_index_topk(q, k, w, K, pos, doc_start)
    assert torch.equal(got, ref)
    assert (got[:, :30, -1] == -1).all() and (got[:, 100:240, -1] >= 0).all() and (got[:, 240:270, -1] == -1).all()


@pytest.mark.parametrize("n,dn,dc,threads", [(4, 80, 64, 1), (3, 14, 10, 2)])
def test_sparse_latent_kernel_matches_torch_path_forward_and_backward(n, dn, dc, threads):
    g = torch.Generator().manual_seed(2)
    S, K = 150, 24
    q = torch.randn(S, n, dn, generator=g, dtype=torch.float32)
    lat = torch.randn(S, dn, generator=g)
    scores = torch.randn(S, S, generator=g).masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    with kernels.disabled():
        idx = deterministic_topk(scores, K)  # rows < K carry -1
    go = torch.randn(S, n, dc, generator=g)
    results = []
    old = torch.get_num_threads()
    for use in (True, False):
        qq, ll = q.clone().requires_grad_(True), lat.clone().requires_grad_(True)
        torch.set_num_threads(threads)
        try:
            if use:
                out = SparseLatentAttention.apply(qq, ll, idx, 0.3, dc)
            else:
                with kernels.disabled():
                    out = SparseLatentAttention.apply(qq, ll, idx, 0.3, dc)
            out.backward(go)
        finally:
            torch.set_num_threads(old)
        results.append((out.detach(), qq.grad, ll.grad))
    for a, r in zip(*results):
        assert (a - r).abs().max() <= 1e-5 * (1 + r.abs().max())


def _selected(S, K, g):
    """[S, K] causal top-k indices of random scores: rows < K carry -1."""
    scores = torch.randn(S, S, generator=g).masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    with kernels.disabled():
        return deterministic_topk(scores, K)


@pytest.mark.parametrize("n,D,nI,dI,threads", [(4, 80, 4, 32, 1), (3, 14, 5, 10, 2)])
def test_sparse_loss_kernels_match_torch_path_forward_and_backward(n, D, nI, dI, threads):
    """The sparse stage's fused scoring (``kernels.sparse_latent_target``, ``indexer_kl`` / ``_grad``) equals
    the PyTorch path it replaces: the absorbed attention target over the selected latent rows, and the
    indexer KL's value and gradients (q, w, k), rows with -1 slots, head and width counts that are not
    multiples of 4 / 16, one and two threads. The kernels read the selected rows in place: no op makes a
    gathered [rows, K, width] block (the old code, PyTorch ops on the CPU too, made S·K·D)."""
    from glm5_mcore.model.indexer_loss import SparseIndexerKL, compute_sparse_attention_target_latent

    g = torch.Generator().manual_seed(3)
    S, K = 150, 24
    idx = _selected(S, K, g)
    q, lat = torch.randn(S, n, D, generator=g), torch.randn(S, D, generator=g)
    qi, wi, ki = torch.randn(S, nI, dI, generator=g), torch.randn(S, nI, generator=g), torch.randn(S, dI, generator=g)
    old = torch.get_num_threads()
    results = []
    for use in (True, False):
        torch.set_num_threads(threads)
        try:
            largest = LargestTensor()
            with contextlib.nullcontext() if use else kernels.disabled(), largest:
                target = compute_sparse_attention_target_latent(q, lat, idx[None], 0.3)[0]
                a, b, c = (x.clone().requires_grad_() for x in (qi, wi, ki))
                kl = SparseIndexerKL.apply(a, b, c, idx, target)
                (1.7 * kl).backward()
        finally:
            torch.set_num_threads(old)
        if use:
            assert largest.numel < S * K * min(D, dI), largest.numel
        results.append((target, kl.detach(), a.grad, b.grad, c.grad))
    assert bool((results[1][0][idx < 0] == 0).all()) and bool((results[1][0].sum(-1) - 1).abs().max() < 1e-5)
    for got, want in zip(*results):
        assert (got - want).abs().max() <= 1e-5 * (1 + want.abs().max()), float((got - want).abs().max())


def test_without_a_compiler_the_torch_path_is_used(monkeypatch, tmp_path):
    monkeypatch.setattr(kernels, "_lib", None)
    monkeypatch.setattr(kernels, "_failed", None)
    monkeypatch.setenv("CXX", "/bin/false")
    monkeypatch.setenv("GLM5_KERNEL_CACHE", str(tmp_path))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert not kernels.available()
    assert any("PyTorch ops" in str(w.message) for w in caught)
    assert not kernels.use_for(torch.zeros(1))
    s = torch.tensor([[0.0, 1.0, 0.0, 1.0, 0.0]])
    assert deterministic_topk(s, 3).tolist() == [[0, 1, 3]]
    assert list(tmp_path.iterdir()) == []  # the failed build left nothing behind

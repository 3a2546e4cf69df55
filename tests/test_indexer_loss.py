"""DSA's sparse-stage indexer loss: a hand-written reference and Megatron-Core's own function on the
same tensors, gradients reaching the indexer alone, TP/CP equal one rank, the recall it keeps, and
the refusal of an indexer that trains with no loss."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent


def _case(seed=0, b=2, S=24, n=3, h=8, nI=4, dI=6, K=5):
    """Random MLA query/key, indexer q/w/k, two packed documents per row (THD bounds)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).float()  # noqa: E731
    q_pos = torch.arange(S)
    doc_start = torch.where(q_pos < 10, 0, 10)
    return dict(query=r(S, b, n, h), key=r(S, b, n, h), q_i=r(S, b, nI, dI).requires_grad_(),
                w_i=(0.3 * r(S, b, nI)).requires_grad_(), k_i=r(S, b, dI).requires_grad_(), q_pos=q_pos,
                doc_start=doc_start, K=K, scale=h ** -0.5)


def _reference(c, topk, coeff):
    """Per query: KL over its selected keys only; target = Σ_heads softmax(q·k·scale) over them,
    normalised to 1; prediction = softmax of Σ_h w·ReLU(q_i·k_i) over them. Summed over rows × coeff
    (Megatron-Core's ``calculate_per_token_loss``)."""
    S, b, n, _ = c["query"].shape
    total = 0.0
    for bi in range(b):
        for s in range(S):
            J = [int(j) for j in topk[bi, s] if j >= 0]
            att = torch.zeros(len(J), dtype=torch.float64)
            for hd in range(n):
                lg = torch.stack([c["query"][s, bi, hd].double() @ c["key"][j, bi, hd].double() for j in J])
                att += torch.softmax(lg * c["scale"], 0)
            t = att / att.sum()
            idx = torch.stack([(c["w_i"][s, bi].double() * torch.relu(c["q_i"][s, bi].double() @ c["k_i"][j, bi].double())).sum()
                               for j in J])
            logp = torch.log_softmax(idx, 0)
            total = total + (t * (t.log() - logp)).sum()
    return total * coeff


def _topk(c):
    from glm5_mcore.dsa import compute_index_topk

    with torch.no_grad():
        return compute_index_topk(c["q_i"], c["k_i"], c["w_i"], c["K"], c["q_pos"], c["doc_start"])


def test_sparse_loss_equals_hand_reference_and_megatron_core():
    from megatron.core.transformer.experimental_attention_variant.dsa import _compute_index_scores, compute_dsa_indexer_loss

    from glm5_mcore.indexer_loss import compute_sparse_attention_target, compute_sparse_indexer_loss

    class _PG:  # TP size 1, as compute_dsa_indexer_loss asks
        class tp:
            @staticmethod
            def size():
                return 1

    c = _case()
    topk = _topk(c)
    assert bool((topk[:, :3] < 0).any()) and bool((topk[:, 14:] >= 0).all())  # short rows keep -1 slots
    target = compute_sparse_attention_target(c["query"], c["key"], topk, c["scale"])
    got, kl_sum = compute_sparse_indexer_loss(c["q_i"], c["w_i"], c["k_i"], topk, target, 0.01, True)
    ref = _reference(c, topk, 0.01)
    assert abs(float(got) - float(ref)) <= 1e-5 * abs(float(ref)), (float(got), float(ref))
    assert abs(float(kl_sum) * 0.01 - float(got)) <= 1e-7
    grads = torch.autograd.grad(got, (c["q_i"], c["w_i"], c["k_i"]))
    gref = torch.autograd.grad(ref, (c["q_i"], c["w_i"], c["k_i"]))
    for a, r in zip(grads, gref):
        assert (a.double() - r).abs().max() <= 1e-5 * (1 + r.abs().max()), float((a.double() - r).abs().max())
    # Megatron-Core's own dense-tensor form, sparse_loss=True, mean over rows
    scores = _compute_index_scores(c["q_i"], c["w_i"], c["k_i"])
    mc = compute_dsa_indexer_loss(scores, topk, c["query"], c["key"], c["scale"], 0.01, True, _PG,
                                  varlen_starts=c["doc_start"], varlen_ends=c["q_pos"] + 1,
                                  key_positions=torch.arange(c["q_pos"].numel()))
    mine, _ = compute_sparse_indexer_loss(c["q_i"], c["w_i"], c["k_i"], topk, target, 0.01, False)
    assert abs(float(mine) - float(mc)) <= 1e-5 * abs(float(mc)), (float(mine), float(mc))
    gm = torch.autograd.grad(mc, (c["q_i"], c["w_i"], c["k_i"]))
    g2 = torch.autograd.grad(mine, (c["q_i"], c["w_i"], c["k_i"]))
    for a, r in zip(g2, gm):
        assert (a - r).abs().max() <= 1e-5 * (1 + r.abs().max())


def test_recall_counts_dense_mass_in_topk_on_eligible_rows():
    from glm5_mcore.indexer_loss import compute_topk_recall

    c = _case(seed=3, b=1)
    topk = _topk(c)
    tot, n = compute_topk_recall(c["query"], c["key"], topk, c["q_pos"], c["doc_start"], c["scale"])
    S, _, nh, _ = c["query"].shape
    want, rows = 0.0, 0
    for s in range(S):
        lo, hi = int(c["doc_start"][s]), int(c["q_pos"][s])
        if hi - lo + 1 <= c["K"]:
            continue
        p = sum(torch.softmax(torch.stack([c["query"][s, 0, hd] @ c["key"][u, 0, hd] for u in range(lo, hi + 1)])
                              * c["scale"], 0) for hd in range(nh)) / nh
        want += float(sum(p[int(j) - lo] for j in topk[0, s] if j >= 0))
        rows += 1
    assert n == rows and abs(tot - want) <= 1e-5 * rows, (tot, want)
    part, m = compute_topk_recall(c["query"], c["key"], topk, c["q_pos"], c["doc_start"], c["scale"], max_rows=4)
    assert m == 4 and 0 < part < 4

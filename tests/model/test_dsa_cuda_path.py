"""DSA's accelerator path proven on the CPU (issue 29, issue 28 C1-C3/D2): no host reads under a stand-in
device, the sync-free top-k and the chunked warm-up equal their references, the CP gather carries only the
latent, and the bytes saved for backward equal the planner's line."""

import contextlib

import pytest
import torch

from glm5_mcore.probes.fake_device import fake_device, host
from glm5_mcore.probes.host_reads import count_host_reads
from tests.support.helpers import LargestTensor


def _attention_layer(hf_dir, dev_ctx):
    """The first DSA layer's MLA self-attention (its core: ``GLM5SparseAttention``) of the tiny model."""
    from glm5_mcore.config import GLM5Config
    from glm5_mcore.mcore_settings import ParallelConfig
    from glm5_mcore.checkpoint.hf_load import load_hf_weights
    from glm5_mcore.model.build import build_model

    glm5 = GLM5Config.from_hf_dir(hf_dir)
    m = build_model(glm5, ParallelConfig())
    load_hf_weights(m, hf_dir, glm5)
    return m, m.decoder.layers[1].self_attention


def _thd(S, lengths, device):
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths),
                           max_seqlen_kv=max(lengths))


MEGATRON_THD_ROPE = "megatron/core/models/common/embeddings/rope_utils.py:22"  # the local spec's THD RoPE (also in the indexer)


@pytest.mark.parametrize("stage", ["sparse", "sparse_loss", "warmup"])
def test_dsa_layer_forward_backward_reads_nothing_back_from_the_device(tiny_dir, single_rank, stage):
    """The CUDA code path (PyTorch fallback: what runs on any non-CPU device without fused kernels)
    through one DSA attention layer, THD with three documents: the core's forward (indexer, top-k,
    sparse core, indexer loss, recall probe) and the layer's backward make zero host reads. (The
    layer's forward outside the core has Megatron's own: the local spec's THD RoPE reads
    ``cu_seqlens.tolist()``, rope_utils.py:222; Transformer Engine's fused RoPE does not.)"""
    from megatron.core.transformer.experimental_attention_variant.dsa import DSAIndexerLossAutoScaler

    from glm5_mcore.model.dsa import GLM5SparseAttention
    from glm5_mcore.model.indexer_stages import set_indexer_frozen, set_indexer_warmup, set_recall_probe

    with fake_device() as dev:
        m, attn = _attention_layer(tiny_dir, dev)
        core = attn.core_attention
        assert isinstance(core, GLM5SparseAttention) and core._kv_up
        core.keep_topk = True  # read below: the sparse path ran
        m.train()
        if stage == "sparse_loss":
            set_indexer_frozen(m, False)
            core.config.dsa_indexer_loss_coeff = 0.01
        if stage == "warmup":
            set_indexer_frozen(m, False)
            set_indexer_warmup(m, 0.01)
        set_recall_probe(m, True)
        S, H = 40, m.config.hidden_size
        x = torch.randn(S, 1, H, generator=torch.Generator().manual_seed(0)).to(dev).requires_grad_()
        psp = _thd(S, [12, 20, 8], dev)
        hooks = []
        DSAIndexerLossAutoScaler.main_loss_backward_scale = None  # the schedule sets a device scale (an earlier
        DSAIndexerLossAutoScaler.set_loss_scale(torch.ones((), device=dev))  # CPU test may have left a CPU one)
        try:
            with count_host_reads() as reads:  # the DSA core's forward (indexer included) and the layer's backward
                reads.active = False
                hooks = [core.register_forward_pre_hook(lambda *_: setattr(reads, "active", True)),
                         core.register_forward_hook(lambda *_: setattr(reads, "active", False))]
                out, _ = attn(x, None, packed_seq_params=psp)  # MLA builds its own RoPE
                reads.active = True
                out.square().sum().backward()
        finally:
            for h in hooks:
                h.remove()
            core.config.dsa_indexer_loss_coeff = 0.0
            set_indexer_warmup(m, 0.0)
    assert host(x.grad).abs().sum() > 0 and core.last_topk is not None or stage == "warmup"
    ours = [r for r in reads.reads if not r[1].startswith(MEGATRON_THD_ROPE)]
    assert not ours, f"{len(ours)} host reads: {ours[:8]}"


def _core_saved_bytes(T, n, K, fake: bool, m, seed=0):
    """Unique storages the absorbed DSA core keeps for backward (``saved_tensors_hooks``, bf16): the
    MLA's query [T, 1, n, dn+dr], the latent row [T, 1, 576] and kv_up weight come in as the layer
    gives them; the weight (a parameter) is not counted."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.multiprocessing.reductions import StorageWeakRef

    from glm5_mcore import kernels
    from glm5_mcore.model.sparse_attention import absorbed_query, latent_attention

    dn, dr, dv, dc = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim, m.kv_lora_rank
    saved = {}

    def pack(t):
        st = t.untyped_storage()
        saved.setdefault(StorageWeakRef(st), st.nbytes())
        return t

    ctx = FakeTensorMode() if fake else contextlib.nullcontext()
    g = torch.Generator().manual_seed(seed)
    with ctx:
        bf = dict(dtype=torch.bfloat16)
        if fake:
            query, lat = torch.empty(T, 1, n, dn + dr, **bf), torch.empty(T, 1, dc + dr, **bf)
            w = torch.empty(n * (dn + dv), dc, **bf)
            topk = torch.empty(1, T, K, dtype=torch.int64)
        else:
            query, lat = torch.randn(T, 1, n, dn + dr, generator=g).to(**bf), torch.randn(T, 1, dc + dr, generator=g).to(**bf)
            w = (0.1 * torch.randn(n * (dn + dv), dc, generator=g)).to(**bf)
            topk = torch.sort(torch.randint(0, T, (1, T, K), generator=g), -1).values
        query.requires_grad_(), lat.requires_grad_()
        w = torch.nn.Parameter(w)
        wid = StorageWeakRef(w.untyped_storage())
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), kernels.disabled():
            out = latent_attention(absorbed_query(query, w, dn, dv), lat, w, topk, 0.1, dn, dv)
    saved.pop(wid, None)
    return sum(saved.values()), out


@pytest.mark.parametrize("T,tp,fake", [(1024, 8, False), (32768, 8, True), (131072, 8, True), (32768, 1, True)])
def test_saved_bytes_per_token_per_head_equal_the_planner(T, tp, fake, monkeypatch):
    """Issue 28 C1: what the core saves for backward (bf16) equals the planner's DSA line within 10 %:
    real tensors at 1K tokens, fake tensors at full width (64 heads / TP, 576-wide latent, top-k 2048)
    at 32K and 128K. The old line (s·h·v + 4·s·h + 8·s·K: a fused kernel's) was 7x under."""
    from glm5_mcore.config import glm5_744b
    from glm5_mcore.plan.activations import core_attention_bytes
    from glm5_mcore.plan.layout import Layout

    if fake:  # what is saved does not depend on the chunking: one chunk keeps the fake run to seconds
        monkeypatch.setattr("glm5_mcore.model.sparse_attention.CHUNK_BYTES", 1 << 50)
    m = glm5_744b()
    n = m.num_attention_heads // tp
    K = m.index_topk if fake else 256
    got, _ = _core_saved_bytes(T, n, K, fake, m)
    L = Layout(world=tp, tp=tp)
    m.index_topk = K
    want = core_attention_bytes(m, L, T, 2, fused=False) + 8 * T * K + 2 * T * n * m.qk_head_dim  # + top-k, q
    per_head = (got - 2 * T * (m.kv_lora_rank + m.qk_rope_head_dim) - 8 * T * K) / (T * n)
    print(f"T={T} TP={tp}: saved {got / 2**30:.2f} GiB, planner {want / 2**30:.2f} GiB, "
          f"{per_head:.0f} B per token per local head besides the latent rows and indices")
    assert abs(got - want) <= 0.10 * want, (got, want)


class _TwoRankCP:
    """A context-parallel group of 2 seen from rank 0 (only its size and rank are read)."""

    def size(self):
        return 2

    def rank(self):
        return 0


def test_cp_all_gathers_only_the_576_wide_latent(tiny_dir, single_rank, monkeypatch):
    """Issue 28 D2: under CP the absorbed core all-gathers one latent row (kv latent ⊕ rope key) and the
    indexer key per token, not per-head keys and values; the bytes handed to the CP gather are counted."""
    import types

    import glm5_mcore.model.dsa as dsa_mod

    _, attn = _attention_layer(tiny_dir, None)
    core, m = attn.core_attention, attn.config
    sent = []

    def gather(t, group=None, **kw):  # rank 1 holds the same values: enough to count what travels
        if isinstance(group, _TwoRankCP):
            sent.append((t.shape, t.numel() * t.element_size()))
            return torch.cat([t, t])
        return t

    monkeypatch.setattr(dsa_mod, "gather_from_sequence_parallel_region", gather)
    monkeypatch.setattr(core, "pg_collection", types.SimpleNamespace(tp=core.pg_collection.tp, cp=_TwoRankCP()))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    core.train()
    S, b = 16, 1  # this rank's half of 32 tokens (zigzag)
    x = torch.randn(S, b, m.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        attn(x, None)
    D = m.kv_lora_rank + m.qk_pos_emb_head_dim
    widths = sorted(s[-1] for s, _ in sent)
    assert widths == sorted([D, m.dsa_indexer_head_dim]), sent  # the latent row and the indexer key only
    per_token = sum(nb for _, nb in sent) / (S * b)
    old = (m.num_attention_heads * (m.qk_head_dim + m.qk_pos_emb_head_dim + m.v_head_dim) + m.kv_lora_rank
           + m.dsa_indexer_head_dim) * 4  # key + value per head, the latent, the indexer key (fp32 here)
    print(f"CP gather: {per_token:.0f} B per token (per-head K/V: {old} B)")
    assert per_token == (D + m.dsa_indexer_head_dim) * 4


def test_warmup_loss_equals_megatron_dense_kl_without_a_T_by_T_tensor(monkeypatch):
    """Issue 28 C3: the warm-up's dense KL (``DenseIndexerKL``, chunked by query rows) equals Megatron-Core's
    ``compute_dsa_indexer_loss(sparse_loss=False)`` in value and indexer gradients (THD, two documents),
    while no op produces a tensor as large as [S, T] (the old code built [b, S, nI, T] and [b, n, S, T])."""
    from megatron.core.transformer.experimental_attention_variant import dsa_indexer_loss
    from megatron.core.transformer.experimental_attention_variant.dsa import (_compute_index_scores,
                                                                              compute_dsa_indexer_loss)

    from glm5_mcore.model.indexer_loss import DenseIndexerKL, dense_kl_row_bytes

    g = torch.Generator().manual_seed(4)
    S, n, h, nI, dI, K = 48, 3, 8, 4, 6, 5
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    query, key = r(S, 1, n, h), r(S, 1, n, h)
    q_i, w_i, k_i = r(S, 1, nI, dI).requires_grad_(), (0.3 * r(S, 1, nI)).requires_grad_(), r(S, 1, dI).requires_grad_()
    q_pos = torch.arange(S)
    doc_start = torch.where(q_pos < 20, 0, 20)
    pg = type("PG", (), {"tp": type("G", (), {"size": lambda self: 1})()})()
    ref = compute_dsa_indexer_loss(_compute_index_scores(q_i, w_i, k_i), torch.zeros(1, S, K, dtype=torch.long),
                                   query, key, h ** -0.5, 1.0, False, pg, varlen_starts=doc_start,
                                   varlen_ends=q_pos + 1, key_positions=torch.arange(S))
    g_ref = torch.autograd.grad(ref, (q_i, w_i, k_i))
    monkeypatch.setattr("glm5_mcore.model.sparse_attention.CHUNK_BYTES", dense_kl_row_bytes(S, n, nI) * 7)  # 7 rows
    largest = LargestTensor()
    with largest:
        kl, mass, rows = DenseIndexerKL.apply(q_i, w_i, k_i, query, key, q_pos, doc_start, h ** -0.5, K, None)
        loss = dsa_indexer_loss.reduce_indexer_kl_sum(kl, num_rows=S, calculate_per_token_loss=False)
        g_got = torch.autograd.grad(loss, (q_i, w_i, k_i))
    assert abs(float(loss) - float(ref)) <= 1e-5 * abs(float(ref)), (float(loss), float(ref))
    for a, b in zip(g_got, g_ref):
        assert (a - b).abs().max() <= 1e-5 * (1 + b.abs().max())
    assert largest.numel < S * S, largest.numel
    assert int(rows) == int(((q_pos - doc_start + 1) > K).sum()) and 0 < float(mass) <= int(rows)


def _thd_case(seed=0, S=40, n=4, dn=8, dr=4, dc=12, dv=6, nI=4, dI=8, K=6):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q_pos = torch.arange(S)
    doc_start = torch.tensor([0] * 12 + [12] * 20 + [32] * 8)  # three packed documents
    return dict(S=S, n=n, dn=dn, dr=dr, dc=dc, dv=dv, K=K, q_pos=q_pos, doc_start=doc_start,
                q_i=r(S, 1, nI, dI), w_i=0.3 * r(S, 1, nI), k_i=r(S, 1, dI), query=r(S, 1, n, dn + dr),
                lat=r(S, 1, dc + dr), w=0.3 * r(n * (dn + dv), dc))


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_core_equals_megatron_naive_references_thd(cpu_kernels):
    """Issue 29 item 4: on the same tensors (THD, three documents) our indexer top-k equals
    ``fused_qk_topk_naive``'s sets, our absorbed core equals ``_unfused_absorbed_dsa_fn`` + the W_uv
    einsum Megatron-Core applies after it, and our per-head core equals ``unfused_dsa_fn``, forward and
    backward, on the CPU kernels and on the PyTorch (device) path. With "mcore's fused kernels equal
    these references" (tested upstream), ours = theirs. The top-k sets are equal on every row whose
    K-th score is not tied beyond the set; on tied rows ``torch.topk`` picks, our rule takes the lower
    key index (the contract, docs/dsa.md)."""
    from megatron.core.transformer.experimental_attention_variant.dsa import (_unfused_absorbed_dsa_fn,
                                                                              fused_qk_topk_naive, unfused_dsa_fn)

    from glm5_mcore import kernels
    from glm5_mcore.model.sparse_attention import (absorbed_query, compute_index_topk, latent_attention,
                                                   sparse_attention)

    c = _thd_case()
    S, n, dn, dv, K = c["S"], c["n"], c["dn"], c["dv"], c["K"]
    bounds = dict(varlen_starts=c["doc_start"], varlen_ends=c["q_pos"] + 1, key_positions=torch.arange(S))
    ctx = contextlib.nullcontext() if cpu_kernels else kernels.disabled()
    with ctx:
        ours = compute_index_topk(c["q_i"], c["k_i"], c["w_i"], K, c["q_pos"], c["doc_start"], natural=True)
        scores, ref = fused_qk_topk_naive(c["q_i"], c["k_i"], c["w_i"], K, **bounds)
        key_ = lambda t: torch.where(t < 0, S, t).sort(-1).values  # noqa: E731  (sets, -1 last)
        kth = scores.topk(K, -1).values[..., -1:]
        tied = ((scores >= kth) & (scores > float("-inf"))).sum(-1) > K  # torch.topk picks among these ties
        same = (key_(ours) == key_(ref)).all(-1)
        assert bool(same[~tied].all()) and int(tied.sum()) < S // 4, (int(tied.sum()), (~same & ~tied).nonzero())
        assert torch.equal(ours, torch.where(ours < 0, S, ours).sort(-1).values.masked_fill(ours < 0, -1))

        scale = (dn + c["dr"]) ** -0.5
        q = c["query"].clone().requires_grad_()
        lat = c["lat"].clone().requires_grad_()
        w = c["w"].clone().requires_grad_()
        got = latent_attention(absorbed_query(q, w, dn, dv), lat, w, ours, scale, dn, dv)
        w_uv = w.view(n, dn + dv, -1)[:, dn:]
        want = torch.einsum("sbhc,hdc->sbhd", _unfused_absorbed_dsa_fn(
            absorbed_query(q, w, dn, dv), lat.unsqueeze(2), ours, scale, c["dc"], **bounds), w_uv).reshape(S, 1, -1)
        assert (got - want).abs().max() <= 1e-5
        g1 = torch.autograd.grad(got.square().sum(), (q, lat, w))
        g2 = torch.autograd.grad(want.square().sum(), (q, lat, w))
        for a, b in zip(g1, g2):
            assert (a - b).abs().max() <= 1e-4 * (1 + b.abs().max())

        kk = torch.randn(S, 1, n, dn + c["dr"], generator=torch.Generator().manual_seed(1)).requires_grad_()
        vv = torch.randn(S, 1, n, dv, generator=torch.Generator().manual_seed(2)).requires_grad_()
        got = sparse_attention(q, kk, vv, ours, scale)
        want = unfused_dsa_fn(q, kk, vv, ours, scale, **bounds).reshape(S, 1, -1)
        assert (got - want).abs().max() <= 1e-5
        g1 = torch.autograd.grad(got.square().sum(), (q, kk, vv))
        g2 = torch.autograd.grad(want.square().sum(), (q, kk, vv))
        for a, b in zip(g1, g2):
            assert (a - b).abs().max() <= 1e-4 * (1 + b.abs().max())


def test_sync_free_topk_keeps_the_tie_rule_and_minus_inf_rows():
    """The device path's top-k (cumsum + scatter, no host read) picks exactly the CPU kernel's sets:
    ties to the lower index, ascending, -1 last for rows with fewer than k finite scores."""
    from glm5_mcore import kernels
    from glm5_mcore.model.sparse_attention import deterministic_topk

    g = torch.Generator().manual_seed(0)
    s = torch.randint(0, 4, (64, 40), generator=g).float()  # heavy ties
    s[::5, 7:] = float("-inf")  # rows with 7 finite scores
    for k in (3, 8, 12):
        ref = deterministic_topk(s, k)
        with kernels.disabled():
            got = deterministic_topk(s, k)
        assert torch.equal(got, ref), k
    assert deterministic_topk(torch.tensor([[1.0, 2.0, 2.0, 2.0, float("-inf")]]), 4).tolist() == [[0, 1, 2, 3]]
    with kernels.disabled():
        assert deterministic_topk(torch.tensor([[2.0, 2.0, float("-inf"), 2.0]]), 4).tolist() == [[0, 1, 3, -1]]


def test_fused_backend_constraints_refused_with_one_line_naming_the_setting():
    """Issue 29 item 1: the fused kernels' constraints (bf16, top-k % 64, heads per rank, 512 + 64 latent,
    indexer heads for its backward) checked before any work, one line naming model.dsa_kernel_backend."""
    from types import SimpleNamespace

    from glm5_mcore.model import dsa_backend

    ok = SimpleNamespace(dsa_kernel_backend="tilelang", num_attention_heads=64, params_dtype=torch.bfloat16,
                         dsa_indexer_topk=2048, kv_lora_rank=512, qk_pos_emb_head_dim=64, dsa_indexer_n_heads=32)
    for tp in (1, 2, 4, 8):
        dsa_backend.check(ok, tp=tp, trains_indexer=True, package_check=False)
    bad = dict(params_dtype=torch.float32, dsa_indexer_topk=1000, num_attention_heads=48 * 8, kv_lora_rank=256,
               dsa_indexer_n_heads=12)
    for field, value in bad.items():
        cfg = SimpleNamespace(**{**vars(ok), field: value})
        with pytest.raises(ValueError) as e:
            dsa_backend.check(cfg, tp=8, trains_indexer=True, package_check=False)
        assert str(e.value).startswith("model.dsa_kernel_backend=tilelang: ") and "\n" not in str(e.value), field
    with pytest.raises(ValueError, match="model.dsa_kernel_backend=tilelang: fused DSA kernels run on CUDA only"):
        dsa_backend.resolve("tilelang", "cpu")
    assert dsa_backend.resolve("auto", "cpu") == "none" and dsa_backend.resolve("auto", "meta") == "none"


def test_fused_hooks_plumbing_equals_the_pytorch_core(tiny_dir, single_rank, monkeypatch):
    """The fused path's adapters (``dsa_backend``: bounds, the top-k put in the contract's order from an
    unordered int32 result with -1 anywhere, the absorbed query/latent layouts, the W_uv einsum) run on
    the CPU with Megatron-Core's hooks answered by its own naive references (the functions its fused
    kernels are tested against): the layer equals the PyTorch path, forward and backward."""
    from megatron.core.transformer.experimental_attention_variant.dsa import (_unfused_absorbed_dsa_fn,
                                                                              fused_qk_topk_naive)

    from glm5_mcore.model import dsa_backend

    m, attn = _attention_layer(tiny_dir, None)
    core = attn.core_attention
    S = 40
    psp = _thd(S, [12, 20, 8], "cpu")
    calls = []

    def qk_topk(config, q, k, weights, index_topk, starts, ends, block_size, use_relu=True, **kw):
        _, idx = fused_qk_topk_naive(q.float(), k.float(), weights, index_topk, varlen_starts=starts.long(),
                                     varlen_ends=ends.long(), key_positions=torch.arange(k.shape[0]), use_relu=use_relu)
        perm = torch.randperm(idx.shape[-1], generator=torch.Generator().manual_seed(len(calls)))
        calls.append("topk")
        return idx[..., perm].to(torch.int32), None  # unordered, -1 anywhere: as TileLang returns it

    def absorbed(config, query, key, topk_indices, softmax_scale, v_channels, topk_length=None):
        calls.append("core")
        pos = torch.arange(query.shape[0])
        starts = torch.tensor([0] * 12 + [12] * 20 + [32] * 8)
        return _unfused_absorbed_dsa_fn(query, key, topk_indices.long(), softmax_scale, v_channels,
                                        varlen_starts=starts, varlen_ends=pos + 1, key_positions=pos)

    monkeypatch.setattr(dsa_backend.dsa_kernels, "run_fused_qk_topk", qk_topk)
    monkeypatch.setattr(dsa_backend.dsa_kernels, "run_fused_absorbed_sparse_attention", absorbed)
    x0 = torch.randn(S, 1, m.config.hidden_size, generator=torch.Generator().manual_seed(0))

    core.keep_topk = True  # the top-k sets compared below

    def run(fused):
        core.fused = fused
        x = x0.clone().requires_grad_()
        out, _ = attn(x, None, packed_seq_params=psp)  # MLA builds its own RoPE
        out.square().sum().backward()
        return out.detach(), x.grad, core.last_topk.clone()

    ref_out, ref_g, ref_topk = run(False)
    out, g, topk = run(True)
    assert calls == ["topk", "core"]
    assert torch.equal(topk.long(), ref_topk)  # no ties in this case: the same sets, in the same order
    assert (out - ref_out).abs().max() <= 1e-5 and (g - ref_g).abs().max() <= 1e-5

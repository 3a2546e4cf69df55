"""DSA's sparse-stage indexer loss: a hand-written reference and Megatron-Core's own function on the
same tensors, gradients reaching the indexer alone, TP/CP equal one rank, the recall it keeps, and
the refusal of an indexer that trains with no loss."""


import pytest
import torch

from tests.support.launch import torchrun



def _case(seed=0, b=2, S=24, n=3, h=8, nI=4, dI=6, K=5):
    """Random MLA query/key, indexer q/w/k, two packed documents per row (THD bounds)."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).float()  # noqa: E731
    q_pos = torch.arange(S)
    doc_start = torch.where(q_pos < 10, 0, 10)
    return dict(query=r(S, b, n, h), key=r(S, b, n, h), q_i=r(S, b, nI, dI).requires_grad_(),
                w_i=(0.3 * r(S, b, nI)).requires_grad_(), k_i=r(S, b, dI).requires_grad_(), q_pos=q_pos,
                doc_start=doc_start, K=K, scale=h ** -0.5)


def _reference(c, topk, coeff, rows=None):
    """Per query: KL over its selected keys only; target = Σ_heads softmax(q·k·scale) over them,
    normalised to 1; prediction = softmax of Σ_h w·ReLU(q_i·k_i) over them. Summed over rows × coeff
    (Megatron-Core's ``calculate_per_token_loss``)."""
    S, b, n, _ = c["query"].shape
    total = 0.0
    for bi in range(b):
        for s in range(S):
            if rows is not None and not rows[bi, s]:
                continue
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
    from glm5_mcore.model.sparse_attention import compute_index_topk

    with torch.no_grad():
        return compute_index_topk(c["q_i"], c["k_i"], c["w_i"], c["K"], c["q_pos"], c["doc_start"])


def test_sparse_loss_equals_hand_reference_and_megatron_core():
    from megatron.core.transformer.experimental_attention_variant.dsa import _compute_index_scores, compute_dsa_indexer_loss

    from glm5_mcore.model.indexer_loss import compute_sparse_attention_target, compute_sparse_indexer_loss

    class _PG:  # TP size 1, as compute_dsa_indexer_loss asks
        class tp:
            @staticmethod
            def size():
                return 1

    c = _case()
    topk = _topk(c)
    assert bool((topk[:, :3] < 0).any()) and bool((topk[:, 14:] >= 0).all())  # short rows keep -1 slots
    target = compute_sparse_attention_target(c["query"], c["key"], topk, c["scale"])
    got, kl_sum, n = compute_sparse_indexer_loss(c["q_i"], c["w_i"], c["k_i"], topk, target, 0.01, True)
    assert n == topk.shape[0] * topk.shape[1]
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
    mine, _, _ = compute_sparse_indexer_loss(c["q_i"], c["w_i"], c["k_i"], topk, target, 0.01, False)
    assert abs(float(mine) - float(mc)) <= 1e-5 * abs(float(mc)), (float(mine), float(mc))
    gm = torch.autograd.grad(mc, (c["q_i"], c["w_i"], c["k_i"]))
    g2 = torch.autograd.grad(mine, (c["q_i"], c["w_i"], c["k_i"]))
    for a, r in zip(g2, gm):
        assert (a - r).abs().max() <= 1e-5 * (1 + r.abs().max())
    # padding rows marked as Megatron does (real_token_mask_q): they add nothing, and the mean skips them
    keep = torch.rand(topk.shape[:2], generator=torch.Generator().manual_seed(1)) > 0.3
    masked, _, n = compute_sparse_indexer_loss(c["q_i"], c["w_i"], c["k_i"], topk, target, 0.01, True, keep)
    ref = _reference(c, topk, 0.01, keep)
    assert n == int(keep.sum()) and abs(float(masked) - float(ref)) <= 1e-5 * abs(float(ref))
    for a, r in zip(torch.autograd.grad(masked, (c["q_i"], c["w_i"], c["k_i"])),
                    torch.autograd.grad(ref, (c["q_i"], c["w_i"], c["k_i"]))):
        assert (a.double() - r).abs().max() <= 1e-5 * (1 + r.abs().max())
    mc = compute_dsa_indexer_loss(_compute_index_scores(c["q_i"], c["w_i"], c["k_i"]), topk, c["query"], c["key"],
                                  c["scale"], 0.01, True, _PG, varlen_starts=c["doc_start"], varlen_ends=c["q_pos"] + 1,
                                  key_positions=torch.arange(c["q_pos"].numel()), query_valid_rows=keep)
    mine, _, _ = compute_sparse_indexer_loss(c["q_i"], c["w_i"], c["k_i"], topk, target, 0.01, False, keep)
    assert abs(float(mine) - float(mc)) <= 1e-5 * abs(float(mc)), (float(mine), float(mc))


def test_recall_counts_dense_mass_in_topk_on_eligible_rows():
    from glm5_mcore.model.indexer_loss import compute_topk_recall

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
    assert n == rows and abs(float(tot) - want) <= 1e-5 * rows, (float(tot), want)
    part, m = compute_topk_recall(c["query"], c["key"], topk, c["q_pos"], c["doc_start"], c["scale"], max_rows=4)
    assert m == 4 and 0 < float(part) < 4


def _thd_batch(vocab, lengths=(24, 20, 36), seed=5, tp=1):
    from glm5_mcore.data.sft import Document, _batch

    g = torch.Generator().manual_seed(seed)
    return _batch([Document(torch.randint(3, vocab, (n + 1,), generator=g).tolist(), [1] * (n + 1)) for n in lengths],
                  tp)


def test_loss_reaches_only_the_indexer_and_index_share_layers_add_nothing(tiny_share_dir, single_rank):
    from glm5_mcore.model.dsa import GLM5SparseAttention
    from glm5_mcore.model.indexer_stages import indexer_metrics
    from tests.support.helpers import hf_model

    model, glm5 = hf_model(tiny_share_dir, calculate_per_token_loss=True, dsa_indexer_loss_coeff=0.01)
    model.train()
    b = _thd_batch(glm5.vocab_size)
    cores = [m for m in model.modules() if isinstance(m, GLM5SparseAttention)]
    assert [c.computes_topk for c in cores] == [True, True, False, True]  # FFSF

    def grads(coeff):
        model.config.dsa_indexer_loss_coeff = coeff  # one config object, read by every core
        model.zero_grad(set_to_none=True)
        ce = model(b.input_ids, b.position_ids, None, labels=b.labels, packed_seq_params=b.packed_seq_params(),
                   loss_mask=b.loss_mask)
        (ce * b.loss_mask).sum().backward()
        return ce.detach(), {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}

    ce_on, on = grads(0.01)
    stats = [[float(v) for v in c.indexer_stats] for c in cores]
    m = indexer_metrics(model)
    ce_off, off = grads(0.0)
    assert torch.equal(ce_on, ce_off)  # the loss rides on the output without changing it
    idx = [n for n in on if ".indexer." in n]
    assert len(idx) == 3 * 5 and all(on[n] is not None and on[n].abs().sum() > 0 for n in idx)
    assert all(off[n] is None or off[n].abs().sum() == 0 for n in idx)
    rest = [n for n in on if ".indexer." not in n and on[n] is not None]
    assert rest and all(torch.equal(on[n], off[n]) for n in rest), [n for n in rest if not torch.equal(on[n], off[n])]
    T = b.num_tokens
    assert [s[1] for s in stats] == [T, T, 0, T]  # rows per full layer; the shared layer adds nothing
    assert set(m) == {"indexer/loss", "indexer/recall"} and m["indexer/loss"] > 0 and 0 < m["indexer/recall"] < 1
    assert indexer_metrics(model) == {}  # read once: the counters restart
    # the target from the absorbed query and shared latent (default) equals the per-head one
    assert all(c._kv_up for c in cores[:2])
    kv_up = [c._kv_up for c in cores]
    for c in cores:
        c._kv_up = []
    _, per_head = grads(0.01)
    for c, k in zip(cores, kv_up):
        c._kv_up = k
    for n in idx:
        assert (per_head[n] - on[n]).abs().max() <= 1e-5 * on[n].abs().max(), n


@pytest.mark.slow
def test_tp2_and_cp2_equal_one_rank(tiny_share_dir, tmp_path):
    """One torchrun launch: DP 2 (each rank computes one rank's result), then TP 2, then CP 2."""
    from safetensors.torch import load_file

    torchrun("indexer_loss_check.py", tiny_share_dir, tmp_path / "out.st")
    res = load_file(tmp_path / "out.st")
    one = {k.split(".", 1)[1]: v for k, v in res.items() if k.startswith("tp1cp1.")}
    names = [k for k in one if k.startswith("grad.")]
    assert len(names) == 15  # 3 full layers × 5 indexer tensors (the IndexShare layer has none)
    for layout in ("tp2cp1", "tp1cp2"):
        got = {k.split(".", 1)[1]: v for k, v in res.items() if k.startswith(layout + ".")}
        (kl, rows, lm), (kl1, rows1, lm1) = got["stats"].tolist(), one["stats"].tolist()
        assert rows == rows1 and abs(lm - lm1) <= 1e-5 * abs(lm1) and abs(kl - kl1) <= 1e-5 * abs(kl1), (layout, kl, kl1)
        assert set(names) == {k for k in got if k.startswith("grad.")}
        worst = max(float((got[k] - one[k]).abs().max() / one[k].abs().max()) for k in names)
        assert worst <= 1e-5, (layout, worst)


def test_trainable_indexer_without_loss_is_refused_before_any_work(tiny_dir, tmp_path, single_rank):
    from glm5_mcore.model.indexer_stages import check_indexer_learns, set_indexer_frozen
    from tests.support.helpers import hf_model
    from recipes.sft import SFTConfig, run

    base = {"model": {"hf_dir": tiny_dir}, "data": {"train": str(tmp_path / "missing.jsonl")},
            "lora": {"enabled": False}, "train": {"out": str(tmp_path / "run"), "progress": False},
            "wandb": {"mode": "disabled"}}
    bad = {**base, "train": {**base["train"], "freeze_indexer": False, "indexer_loss_coeff": 0.0}}
    with pytest.raises(ValueError, match=r"train\.indexer_loss_coeff=0\.0: the indexer trains \(train\.freeze_indexer=false\)"):
        run(SFTConfig.from_dict(bad))
    lora = {**base, "lora": {"enabled": True}, "train": {**base["train"], "freeze_indexer": False}}
    with pytest.raises(ValueError, match=r"train\.freeze_indexer=false with LoRA.*lora\.targets has none"):
        run(SFTConfig.from_dict(lora))
    assert not (tmp_path / "run").exists()  # nothing read (the data file does not exist), nothing written
    # the same guard on a built model: an unfrozen indexer with dsa_indexer_loss_coeff = 0
    model, _ = hf_model(tiny_dir)
    set_indexer_frozen(model, False)
    with pytest.raises(ValueError, match=r"train\.indexer_loss_coeff: layer 1's DSA indexer requires gradients"):
        check_indexer_learns(model)
    set_indexer_frozen(model, True)
    check_indexer_learns(model)
    from rl.config import RLConfig

    with pytest.raises(ValueError, match=r"trainer\.freeze_indexer=false: the RL trainer keeps the DSA indexer frozen"):
        RLConfig.from_dict({"model": {"hf_dir": tiny_dir}, "trainer": {"freeze_indexer": False}})


def _copy_task(path, n, seed, lo=14, hi=26):
    """The response repeats the prompt's words: learning it moves attention onto far, specific keys."""
    import json
    import random

    r = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            s = " ".join(f"w{r.randrange(90)}" for _ in range(r.randrange(lo, hi)))
            f.write(json.dumps({"prompt": s, "response": s}) + "\n")
    return str(path)


def test_sparse_stage_keeps_recall_and_frozen_indexer_loses_it(tiny_dir, tmp_path, monkeypatch, capfd):
    """Full fine-tuning on a copy task (top-k 8 of up to 64 keys): with the sparse-stage loss the
    indexer's top-k recall of dense attention mass stays at or above its start; frozen, it falls.
    Also: indexer/loss and indexer/recall reach W&B (its run.log) and the console bar."""
    import recipes.sft as sft

    logged = []

    class _Run:
        def log(self, metrics, step):
            logged.append(dict(metrics, step=step))

        def finish(self):
            pass

    monkeypatch.setattr("glm5_mcore.training.loop.init_wandb", lambda *a, **k: _Run())  # what RunLog calls
    train = _copy_task(tmp_path / "copy.jsonl", 256, 0)

    def recall(frozen, progress=False):
        d = {"model": {"hf_dir": tiny_dir},
             "data": {"train": train, "micro_batch_tokens": 128, "global_batch_tokens": 256, "max_tokens": 64},
             "optim": {"lr": 1e-2, "decay_style": "constant"}, "lora": {"enabled": False},
             "train": {"steps": 60, "out": str(tmp_path / f"run{frozen}"), "progress": progress,
                       "freeze_indexer": frozen}}
        h = sft.run(sft.SFTConfig.from_dict(d))["history"]
        r = [x["indexer/recall"] for x in h]
        return sum(r[:10]) / 10, sum(r[-10:]) / 10, h

    start, end, h = recall(False, progress=True)
    f_start, f_end, fh = recall(True)
    assert end >= start + 0.05 and f_end <= f_start - 0.01 and end >= f_end + 0.1, (start, end, f_start, f_end)
    assert h[-1]["indexer/loss"] < 0.5 * h[0]["indexer/loss"]  # the KL over the selected keys is learnt
    assert all("indexer/loss" not in x for x in fh)  # no loss runs for a frozen indexer
    assert len(logged) == 120 and all("indexer/recall" in x for x in logged)
    assert all("indexer/loss" in x for x in logged[:60])
    err = capfd.readouterr().err
    print(f"recall with the sparse-stage loss {start:.3f} -> {end:.3f}; indexer frozen {f_start:.3f} -> {f_end:.3f}; "
          f"indexer/loss {h[0]['indexer/loss']:.3f} -> {h[-1]['indexer/loss']:.3f}")
    assert "indexer/loss=" in err and "indexer/recall=" in err


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_sparse_stage_target_and_gradients_equal_transformers(tiny_dir, single_rank, monkeypatch, cpu_kernels):
    """Issue 43 item 6: in the sparse stage (trainable indexer, its KL on), on the fused CPU kernels and on
    the PyTorch path, against transformers' GlmMoeDsaForCausalLM (eager) on the same weights and tokens:
    every full layer's indexer target (our fused scoring of the selected latent rows) is transformers'
    attention weights summed over heads at those keys, normalised; the logits, and the gradients of the
    embedding and the output layer through every sparse core's backward, equal transformers' (the indexer's
    loss reaches the indexer only, whose weights get gradients)."""
    import contextlib

    from transformers import AutoModelForCausalLM

    import glm5_mcore.model.dsa as dsa_mod
    from glm5_mcore import kernels
    from glm5_mcore.model.build import forward_logits
    from glm5_mcore.parity import load_input_ids
    from tests.support.helpers import hf_model

    ids = load_input_ids(None, 128, 2, 32, seed=3)
    g = torch.randn(2, 32, 128, generator=torch.Generator().manual_seed(0))
    seen = []
    target_of = dsa_mod.compute_sparse_attention_target_latent

    def record(q, lat, topk, scale, tp):
        out = target_of(q, lat, topk, scale, tp)
        seen.append((out, topk))
        return out

    monkeypatch.setattr(dsa_mod, "compute_sparse_attention_target_latent", record)
    model, _ = hf_model(tiny_dir, dsa_indexer_loss_coeff=0.01)
    model.train()
    with contextlib.nullcontext() if cpu_kernels else kernels.disabled():
        logits = forward_logits(model, ids)
        (logits * g).sum().backward()
    hf = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32, attn_implementation="eager")
    weights = []
    for layer in hf.model.layers:
        layer.self_attn.register_forward_hook(lambda mod, inp, out: weights.append(out[1].detach()))
    ref = hf(input_ids=ids).logits
    (ref * g).sum().backward()
    assert (logits - ref).abs().max() <= 1e-5, float((logits - ref).abs().max())
    keep = torch.arange(128) != hf.model.embed_tokens.padding_idx  # transformers zeroes its padding row's gradient
    for ours, theirs in ((model.embedding.word_embeddings.weight.grad[keep], hf.model.embed_tokens.weight.grad[keep]),
                         (model.output_layer.weight.grad, hf.lm_head.weight.grad)):
        assert (ours - theirs).abs().max() <= 1e-5 * (1 + theirs.abs().max()), float((ours - theirs).abs().max())
    indexer = [p for n, p in model.named_parameters() if ".indexer." in n]
    assert indexer and all(p.grad is not None and p.grad.abs().sum() > 0 for p in indexer)
    assert len(seen) == len(weights) == len(hf.model.layers)  # every layer of the tiny model is a full one
    for (target, topk), w in zip(seen, weights):
        att = w.sum(1).gather(-1, topk.clamp(min=0)).masked_fill(topk < 0, 0.0)  # [b, S, K] at our keys
        att = att / att.sum(-1, keepdim=True)
        assert (target - att).abs().max() <= 1e-5, float((target - att).abs().max())


def test_index_share_layers_attend_densely_in_the_warmup_after_an_eval(tiny_share_dir, single_rank):
    """Indexer warm-up: every layer attends densely, IndexShare layers too. An evaluation (SFT's validation
    batch) between warm-up steps leaves the full layer's top-k behind; the next warm-up forward must not hand
    it to the shared layer (the warm-up's full layer returns before selecting one): the same logits as a
    warm-up forward with no evaluation before it, packed (THD) or not."""
    from glm5_mcore.model.indexer_stages import set_indexer_warmup
    from tests.support.helpers import hf_model

    model, glm5 = hf_model(tiny_share_dir, calculate_per_token_loss=True)
    set_indexer_warmup(model, 0.01)
    g = torch.Generator().manual_seed(3)
    ids, other = (torch.randint(3, glm5.vocab_size, (1, 32), generator=g) for _ in range(2))
    pos = torch.arange(32)[None]
    thd, thd_other = _thd_batch(glm5.vocab_size), _thd_batch(glm5.vocab_size, seed=6)

    def warmup_logits(b=None):
        model.train()
        with torch.no_grad():
            if b is None:
                return model(ids, pos, None)
            return model(b.input_ids, b.position_ids, None, packed_seq_params=b.packed_seq_params())

    def evaluate(b=None):
        model.eval()
        with torch.no_grad():
            model(other, pos, None) if b is None else model(b.input_ids, b.position_ids, None,
                                                            packed_seq_params=b.packed_seq_params())

    for plain in (True, False):
        first = warmup_logits(None if plain else thd)
        evaluate(None if plain else thd_other)
        again = warmup_logits(None if plain else thd)
        assert torch.equal(first, again), (plain, float((first - again).abs().max()))

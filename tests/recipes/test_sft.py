"""The SFT recipe: data and packing, THD losses, a tiny run that learns, resume, bad input."""

import json

import pytest
import torch
from safetensors.torch import load_file

from glm5_mcore.convert.lora_export import export_checkpoint_adapter
from glm5_mcore.data.sft import DataError, pack, read_jsonl
from glm5_mcore.lora.state import read_adapter_state

from tests.support.launch import glm5, last_json
from tests.support.sft_setup import reverse_task, sft_cfg, tokenizer


def test_packing_has_no_pads_and_prompt_tokens_carry_no_loss(tiny_dir, tmp_path):
    tok = tokenizer(tiny_dir)
    docs = read_jsonl(reverse_task(tmp_path / "d.jsonl", 20, 3), tok, 64)
    packs = pack(docs, 100)
    assert sum(p.num_tokens for p in packs) == sum(len(d) for d in docs)  # nothing added
    assert all(p.num_tokens <= 100 for p in packs)
    assert all("<pad>" not in p.sources for p in packs)
    first = docs[0]
    prompt_len = len(tok.apply_chat_template([{"role": "user", "content": json.loads(
        (tmp_path / "d.jsonl").read_text().splitlines()[0])["prompt"]}], tokenize=True,
        add_generation_prompt=True)["input_ids"])
    assert first.mask[:prompt_len] == [0] * prompt_len and all(first.mask[prompt_len:])
    b = packs[0]
    assert b.loss_mask[0, : prompt_len - 1].sum() == 0 and b.loss_mask[0, prompt_len - 1] == 1
    assert torch.equal(b.position_ids[0, : len(first)], torch.arange(len(first)))


def test_bad_rows_name_file_and_line_or_are_skipped(tiny_dir, tmp_path):
    tok = tokenizer(tiny_dir)
    p = tmp_path / "bad.jsonl"
    p.write_text('{"text": "w1 w2 w3"}\n{"prompt": "w1", "response": "w2"}\n{"prompt": 3}\nnot json\n'
                 '{"messages": [{"role": "user", "content": "w1"}, {"role": "assistant", "content": "w5 w6"}]}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:3: 'prompt' and a non-empty 'response'"):
        read_jsonl(p, tok, 64)
    from glm5_mcore.data.sft import DataStats

    st = DataStats()
    docs = read_jsonl(p, tok, 64, skip_bad_rows=True, stats=st)
    assert len(docs) == 3 and st.skipped == 2 and "bad.jsonl:4: not valid JSON" in st.errors[1]
    chat = docs[2]  # loss only on the assistant turn (+ EOS)
    assert sum(chat.mask) == 3


def test_thd_packed_losses_equal_unpacked_and_documents_are_independent(tiny_mtp_dir, tmp_path, single_rank):
    from glm5_mcore.config import GLM5Config
    from glm5_mcore.mcore_settings import ParallelConfig
    from glm5_mcore.model.build import build_model
    from glm5_mcore.checkpoint.hf_load import load_hf_weights

    tok = tokenizer(tiny_mtp_dir)
    docs = read_jsonl(reverse_task(tmp_path / "d.jsonl", 3, 5, lengths=(8, 14)), tok, 64)
    glm5 = GLM5Config.from_hf_dir(tiny_mtp_dir)
    m = build_model(glm5, ParallelConfig())
    load_hf_weights(m, tiny_mtp_dir, glm5)
    m.eval()

    def ce(batch):
        with torch.no_grad():
            return m(batch.input_ids, batch.position_ids, None, labels=batch.labels,
                     packed_seq_params=batch.packed_seq_params(), loss_mask=batch.loss_mask)[0]

    packed = pack(docs, 1000)[0]
    assert len(packed.cu_seqlens) == 4
    whole = ce(packed)
    alone = torch.cat([ce(pack([d], 1000)[0]) for d in docs])
    assert (whole - alone).abs().max() <= 1e-5
    docs[1].tokens[3] = (docs[1].tokens[3] + 7) % 100 + 10  # perturb the middle document
    again = ce(pack(docs, 1000)[0])
    cu = packed.cu_seqlens
    for i in (0, 2):
        assert (again[cu[i]:cu[i + 1]] - whole[cu[i]:cu[i + 1]]).abs().max() <= 1e-6
    assert (again[cu[1]:cu[2]] - whole[cu[1]:cu[2]]).abs().max() > 1e-4


def test_tiny_sft_lowers_train_and_validation_loss(tiny_mtp_dir, tmp_path):
    from recipes.sft import run

    out = run(sft_cfg(tiny_mtp_dir, tmp_path, train={"steps": 24, "eval_every": 24}))
    h = out["history"]
    first, last = h[0]["loss"], sum(x["loss"] for x in h[-4:]) / 4
    assert last < first - 0.3, (first, last)
    (s0, v0), (s1, v1) = out["val"][0], out["val"][-1]
    assert s0 == 0 and s1 == 24 and v1 < v0 - 0.1, out["val"]
    assert "mtp_loss/depth_1" in h[-1] and h[-1]["mtp_loss/depth_1"] > 0
    assert "moe/max_over_mean" in h[-1]
    # the run's metrics.jsonl: the W&B names, one row per step (+ the step-0 evaluation); its plot
    from glm5_mcore.plot import SFT_PANELS, plot
    from glm5_mcore.training.run_log import read_metrics

    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(25)) and rows[0] == {"step": 0, "val_loss": out["val"][0][1]}
    assert [r["loss"] for r in rows[1:]] == [x["loss"] for x in h] and rows[24]["val_loss"] == v1
    png = tmp_path / "sft.png"
    assert plot([tmp_path / "run"], png) == [p.title for p in SFT_PANELS]
    assert png.stat().st_size > 10_000


def test_resume_continues_with_identical_losses(tiny_dir, tmp_path):
    from recipes.sft import run

    full = run(sft_cfg(tiny_dir, tmp_path / "a", lora={"enabled": True, "rank": 4},
                    train={"steps": 6, "eval_every": 0, "out": str(tmp_path / "a" / "run")}))["history"]
    cfg = dict(lora={"enabled": True, "rank": 4}, train={"steps": 3, "save_every": 3, "eval_every": 0,
                                                         "out": str(tmp_path / "b" / "run")})
    run(sft_cfg(tiny_dir, tmp_path / "b", **cfg))  # "killed" after step 3's checkpoint
    adapter = tmp_path / "b" / "run" / "iter_0000003" / "adapters" / "default"
    assert adapter.is_dir()
    saved = json.loads((adapter / "adapter_config.json").read_text())["config"]  # LoRACfg.to_lora_config(seed)
    assert saved["seed"] == 1234 and saved["rank"] == 4, saved  # train.seed: the adapters' init seed
    with open(tmp_path / "b" / "run" / "metrics.jsonl", "a") as f:  # step 4 logged, then killed before a save
        f.write(json.dumps({"step": 4, "loss": 99.0}) + "\n")
    cfg["train"]["steps"] = 6
    resumed = run(sft_cfg(tiny_dir, tmp_path / "b", **cfg))
    assert resumed["state"]["step"] == 6 and len(resumed["history"]) == 3
    assert [x["loss"] for x in resumed["history"]] == [x["loss"] for x in full[3:]]
    from glm5_mcore.training.run_log import read_metrics

    rows = read_metrics(tmp_path / "b" / "run" / "metrics.jsonl")  # continued, each step once
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    assert [r["loss"] for r in rows] == [x["loss"] for x in full]


@pytest.mark.slow
def test_config_that_cannot_work_fails_before_work_naming_the_field(tiny_dir, tmp_path):
    sft = ["sft", f"model.hf_dir={tiny_dir}", f"data.train={reverse_task(tmp_path / 't.jsonl', 8, 0)}",
           f"train.out={tmp_path / 'o'}", "wandb.mode=disabled"]
    r = glm5(*sft, "data.global_batch_tokens=1000", "data.micro_batch_tokens=512", "data.max_tokens=64", ok=False)
    assert r.returncode == 2 and "data.global_batch_tokens" in r.stderr, r.stderr[-1500:]
    r = glm5(*sft, "lora.rnak=4", ok=False)
    assert r.returncode != 0 and "rnak" in r.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("mode", [True, "full", "selective"])
def test_recompute_with_pp_on_an_index_share_model_is_accepted(tiny_share_pp_dir, tmp_path, mode):
    """Was: refused ("train.recompute=true with parallel.pp=2: the model has IndexShare layers"), and on the
    CPU at all ("needs CUDA"); a sharer's recompute now reads its own micro-batch's top-k (``tests/layouts``:
    PP 2 + recompute on FSFS equals one rank). A value that is no mode is refused naming the field."""
    from glm5_mcore.config import GLM5Config
    from recipes.sft import SFTConfig, validate

    glm5 = GLM5Config.from_hf_dir(tiny_share_pp_dir)
    assert "shared" in glm5.indexer_types

    def cfg(recompute):
        return SFTConfig.from_dict({"model": {"hf_dir": tiny_share_pp_dir}, "data": {"train": str(tmp_path / "t.jsonl")},
                                    "parallel": {"pp": 2}, "train": {"recompute": recompute}})

    assert validate(cfg(mode), glm5, 2)[0].pp == 2
    with pytest.raises(ValueError, match=r"^train.recompute='some': false, true \(full\), full or selective"):
        validate(cfg("some"), glm5, 2)


def test_mtp_loss_equals_hand_written_reference_and_reaches_mtp_grads(tiny_mtp_dir, tmp_path, single_rank):
    import torch.nn.functional as F

    from glm5_mcore.config import GLM5Config
    from glm5_mcore.mcore_settings import ParallelConfig
    from glm5_mcore.model.build import build_model
    from glm5_mcore.checkpoint.hf_load import load_hf_weights
    from glm5_mcore.model.mtp_loss import mtp_depth_losses

    tok = tokenizer(tiny_mtp_dir)
    docs = read_jsonl(reverse_task(tmp_path / "d.jsonl", 3, 9, lengths=(6, 10)), tok, 64)
    b = pack(docs, 1000)[0]
    glm5 = GLM5Config.from_hf_dir(tiny_mtp_dir)
    m = build_model(glm5, ParallelConfig())
    load_hf_weights(m, tiny_mtp_dir, glm5)
    m.train()
    seen = []
    # clone: the vocab-parallel cross entropy works in place on the logits
    m.output_layer.register_forward_hook(lambda mod, inp, out: seen.append(out[0].detach().clone()))
    mtp_depth_losses(1)  # clear the tracker
    ce = m(b.input_ids, b.position_ids, None, labels=b.labels, packed_seq_params=b.packed_seq_params(),
           loss_mask=b.loss_mask)
    got = mtp_depth_losses(1)["mtp_loss/depth_1"]
    mtp_logits = seen[0][:, 0]  # process_mtp_loss runs the output layer on the MTP hidden states first
    # reference: position i of a document predicts its token i+2, where that target is a loss token
    total, n = 0.0, 0
    for a, e in zip(b.cu_seqlens[:-1].tolist(), b.cu_seqlens[1:].tolist()):
        for i in range(a, e - 1):
            if b.loss_mask[0, i + 1] > 0:
                total += float(F.cross_entropy(mtp_logits[i], b.labels[0, i + 1]))
                n += 1
    assert n > 0 and abs(got - total / n) <= 1e-5, (got, total / n)
    (ce * b.loss_mask).sum().backward()
    grads = {n_: p.grad for n_, p in m.named_parameters() if n_.startswith("mtp.") and ".indexer." not in n_}
    dense = {k: g for k, g in grads.items() if ".local_experts." not in k}  # some experts get no token
    assert dense and all(g is not None and g.abs().sum() > 0 for g in dense.values()), [
        k for k, g in dense.items() if g is None or g.abs().sum() == 0]
    assert any(g is not None and g.abs().sum() > 0 for k, g in grads.items() if ".local_experts." in k)


def test_indexer_warmup_raises_recall(tiny_dir, tmp_path):
    from recipes.sft import run

    out = run(sft_cfg(tiny_dir, tmp_path, train={"steps": 40, "eval_every": 0, "indexer_warmup": True},
                   optim={"lr": 1e-2}, data={"train": reverse_task(tmp_path / "long.jsonl", 64, 2, (16, 28))}))
    h = out["history"]
    assert all("indexer/recall" in x for x in h)
    start = sum(x["indexer/recall"] for x in h[:8]) / 8  # 0.47 -> 0.55 on the tiny random model
    end = sum(x["indexer/recall"] for x in h[-8:]) / 8
    assert end > start + 0.04, (start, end)
    assert h[-1]["indexer/loss"] < h[0]["indexer/loss"]


def test_token_logprob_gradients_match_autograd():
    from glm5_mcore.model.mtp_loss import token_logprobs

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 11, generator=g, requires_grad=True)
    t = torch.randint(0, 11, (3, 5), generator=g)
    lp, h = token_logprobs(x, t, None, temperature=0.7)
    ref = torch.log_softmax(x / 0.7, -1)
    ref_lp, ref_h = ref.gather(-1, t[..., None])[..., 0], -(ref.exp() * ref).sum(-1)
    assert (lp - ref_lp).abs().max() <= 1e-5 and (h - ref_h).abs().max() <= 1e-5
    g1 = torch.autograd.grad((lp * 1.3 + h * 0.7).sum(), x)[0]
    g2 = torch.autograd.grad((ref_lp * 1.3 + ref_h * 0.7).sum(), x)[0]
    assert (g1 - g2).abs().max() <= 1e-5


def _losses(args, nproc, out) -> list:
    """The per-step losses ``glm5 sft ARGS`` prints, on ``nproc`` gloo ranks."""
    return last_json(glm5("sft", *args, f"train.out={out}", nproc=nproc).stdout)["losses"]


@pytest.mark.slow
def test_etp2_with_expert_adapters_gives_one_rank_losses(tiny_dir, tmp_path):
    """Issue 28 item 2 / issue 40 item 2: ``parallel.etp=2`` (Megatron's expert tensor parallelism: each routed
    expert's FFN split over two ranks; the allgather dispatcher then needs equal micro-batch sizes over the ranks)
    with adapters on the routed experts gives one rank's losses and adapter (was: refused, "adapters on the
    routed experts ... not supported with parallel.etp=2"; before the refusal, step 2 differed by 0.28 %)."""
    args = [f"model.hf_dir={tiny_dir}", f"data.train={reverse_task(tmp_path / 't.jsonl', 64, 0)}",
            "data.micro_batch_tokens=128", "data.global_batch_tokens=256", "data.max_tokens=64", "train.steps=2",
            "optim.optimizer=sgd", "optim.lr=0.1", "optim.decay_style=constant", "wandb.mode=disabled",
            "train.progress=false", "lora.rank=4",
            "lora.targets=[linear_q_up_proj,linear_kv_up_proj,linear_fc1,experts.linear_fc1,experts.linear_fc2]"]
    ref = _losses(args, 1, tmp_path / "one")
    got = _losses(args + ["parallel.etp=2"], 2, tmp_path / "etp2")
    assert len(ref) == 2 and max(abs(a - b) / b for a, b in zip(got, ref)) <= 1e-6, (got, ref)
    # the saved adapter (what glm5 lora export reads) gathered over the expert-TP shards: one rank's
    one, two = (read_adapter_state(tmp_path / d / "iter_0000002" / "adapters" / "default") for d in ("one", "etp2"))
    assert sorted(one.A) == sorted(two.A) and any(".experts.local_experts." in k for k in one.A)
    for k in one.A:
        assert torch.allclose(two.delta(k), one.delta(k), rtol=1e-4, atol=1e-7), k
    # and its PEFT export (glm5 lora export: transformers' fused experts' target_parameters): one rank's, 7.5e-7 seen
    peft = {d: load_file(str(export_checkpoint_adapter(tmp_path / d, tmp_path / f"peft_{d}") /
                             "adapter_model.safetensors")) for d in ("one", "etp2")}
    assert sorted(peft["one"]) == sorted(peft["etp2"]) and any(".experts." in k for k in peft["one"])
    for k, t in peft["one"].items():
        assert float((peft["etp2"][k] - t).abs().max()) <= 1e-5 * float(t.abs().max()), k

"""MTP in RL (``actor.mtp_loss_scale > 0``) on a tiny GLM-5 with its MTP layer, in-process: PPO's
log-probs unchanged by it, the MTP loss against a hand-written reference and where its gradient goes,
``rollout/mtp_accept`` against a hand count, the adapter with MTP targets in peft, the refusal of
a folder without MTP tensors, what the vLLM engine pushes to its MTP draft model (no vLLM needed; the
real draft model: ``tests/rl/test_vllm_cpu.py``), and both figures at TP 2 and DP 2 × EP 2 against one rank."""


import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rl.train.batch import fill_log_probs, make_batch

from tests.support.rl_setup import perturb, rl_cfg, rollout, trainer_merged_mtp


from tests.support.launch import torchrun
from tests.support.vllm_stub import recording_engine


@pytest.fixture(scope="module")
def mtp_setup(tiny_mtp_dir):
    from transformers import AutoTokenizer

    from rl.rollout.hf_engine import HFRolloutEngine
    from rl.train.trainer import PolicyTrainer

    cfg = rl_cfg(tiny_mtp_dir, rollout={"temperature": 0.8, "max_new_tokens": 12, "n": 2},
               actor={"mtp_loss_scale": 0.3, "ppo_mini_batch_size": 2})
    trainer = PolicyTrainer(cfg)
    perturb(trainer, scale=0.2)  # MTP-layer adapters included: the draft head moved with the policy
    engine = HFRolloutEngine(tiny_mtp_dir)
    engine.load_adapter(trainer.export_adapter(1))
    tok = AutoTokenizer.from_pretrained(tiny_mtp_dir)
    prompts, results = rollout(cfg, engine, tok, n=2, count=3)
    return cfg, trainer, make_batch(prompts, results, 2)


def _mtp_logits(trainer, mb, train: bool):
    """Depth-1 MTP logits [T, V] of ``mb`` (the first output-layer call of a forward), and log p."""
    seen = []
    h = trainer.model.output_layer.register_forward_hook(lambda m, i, o: seen.append(o[0].detach().clone()))
    try:
        trainer.ddp.train(train)
        logp, _ = trainer._logprobs(trainer.ddp, mb, trainer.cfg.rollout.temperature)
    finally:
        h.remove()
        trainer.ddp.train()
    return seen[0][:, 0].float(), logp


def test_mtp_on_leaves_ppo_logprobs_unchanged(mtp_setup, tiny_mtp_dir):
    """Against a trainer with the MTP loss off: built without the MTP block at all."""
    from glm5_mcore.lora.apply import lora_layers
    from rl.train.trainer import PolicyTrainer

    cfg, trainer, batch = mtp_setup
    off = PolicyTrainer(rl_cfg(tiny_mtp_dir, rollout={"temperature": 0.8}))
    assert off.mtp is None and not any(n.startswith("mtp.") for n, _ in off.model.named_parameters())
    on_lora = {lo.module_name: lo for _, _, lo in lora_layers(trainer.model)}
    with torch.no_grad():
        for _, _, lo in lora_layers(off.model):  # the same adapter on the decoder
            lo.A["default"].copy_(on_lora[lo.module_name].A["default"])
            lo.B["default"].copy_(on_lora[lo.module_name].B["default"])
    a, b = trainer.compute_log_probs(batch), off.compute_log_probs(batch)
    assert a["rows"] == b["rows"]
    for k in ("old_log_probs", "ref_log_probs"):
        assert float((a[k] - b[k]).abs().max()) <= 1e-6, k


def test_mtp_loss_equals_reference_and_reaches_only_mtp_and_adapters(mtp_setup):
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    from glm5_mcore.model.mtp_loss import mtp_depth_losses

    cfg, trainer, batch = mtp_setup
    mb = trainer._micro_batches(batch, list(range(batch.size)))[0]
    mtp_depth_losses(1)  # clear the tracker
    trainer.ddp.zero_grad_buffer()
    logits, logp = _mtp_logits(trainer, mb, train=True)
    got = mtp_depth_losses(1)["mtp_loss/depth_1"]
    # reference: position i of a document predicts its token i+2 (both inside the same document)
    ids, total, n, start = mb.input_ids[0], 0.0, 0, 0
    for L in mb.lengths[: len(mb.rows)]:
        for i in range(start, start + L - 2):
            total += float(F.cross_entropy(logits[i], ids[i + 2]))
            n += 1
        start += L
    assert n > 50 and abs(got - total / n) <= 1e-5, (got, total / n)
    # the MTP loss alone (PPO's output scaled to 0): gradient only in the policy adapter, MTP layer's included
    MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0))
    (logp * 0).sum().backward()
    grads = {n_: p.main_grad for n_, p in trainer.model.named_parameters()
             if getattr(p, "main_grad", None) is not None and p.main_grad.abs().sum() > 0}
    trainer.ddp.zero_grad_buffer()
    assert grads and all(".lora." in k and "default" in k for k in grads), [k for k in grads if ".lora." not in k]
    assert any(k.startswith("mtp.") for k in grads)
    assert not any(p.requires_grad for n_, p in trainer.model.named_parameters() if ".lora." not in n_
                   and n_.startswith("mtp."))


def test_rollout_mtp_accept_equals_hand_count(mtp_setup):
    cfg, trainer, batch = mtp_setup
    trainer.mtp.take()
    trainer.compute_log_probs(batch)
    got = trainer.mtp.take()["rollout/mtp_accept"]
    hit = tot = 0
    for mb in trainer._micro_batches(batch, list(range(batch.size))):
        with torch.no_grad():
            logits, _ = _mtp_logits(trainer, mb, train=False)
        draft = logits.argmax(-1)
        for j, i in enumerate(mb.rows):
            for k in range(1, len(batch.responses[i])):
                t = int(mb.pos[j, k]) + 1  # response token k; drafted at t-2 from token t-1
                hit += int(draft[t - 2] == mb.input_ids[0, t])
                tot += 1
    assert tot > 20 and abs(got - hit / tot) < 1e-12, (got, hit, tot)
    # and the update reports it with the MTP loss
    from rl.train import algos

    batch.scores = torch.rand(batch.size)
    fill_log_probs(batch, [trainer.compute_log_probs(batch)])
    algos.rollout_correction(cfg, batch)
    algos.compute_advantages(cfg, batch, 0.0)
    m = trainer.update(batch, step=0)
    assert m["rollout/mtp_accept"] == pytest.approx(hit / tot) and m["mtp/loss"] > 0, m


def test_adapter_with_mtp_targets_loads_in_peft(mtp_setup, tiny_mtp_dir, tmp_path):
    """Exported under model.layers.{num_hidden_layers}.*: a transformers model with that layer (the
    MTP layer's decoder block, as draft engines name it) loads it with no missing or unexpected keys."""
    from peft import PeftModel
    from peft.utils.save_and_load import set_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg, trainer, batch = mtp_setup
    L = trainer.glm5.num_hidden_layers
    payload = trainer.export_adapter(2, include_mtp=True)
    d = tmp_path / "a"
    d.mkdir()
    for name, data in payload.files.items():
        (d / name).write_bytes(data)
    keys = list(load_file(str(d / "adapter_model.safetensors")))
    assert any(f"model.layers.{L}." in k for k in keys)
    assert not any(f"model.layers.{L}." in k for k in load_file_bytes(trainer.export_adapter(3, include_mtp=False)))
    assert any(f"model.layers.{L}." in k for k in load_file_bytes(trainer.export_adapter(4)))  # trained: pushed
    c = AutoConfig.from_pretrained(tiny_mtp_dir)
    c.num_hidden_layers = L + 1
    c.mlp_layer_types = list(c.mlp_layer_types) + ["sparse"]
    c.indexer_types = list(c.indexer_types) + ["full"]
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(c)
    pm = PeftModel.from_pretrained(base, str(d)).eval()
    res = set_peft_model_state_dict(pm, load_file(str(d / "adapter_model.safetensors")))
    assert res.unexpected_keys == [] and [k for k in res.missing_keys if "lora_" in k] == []


def load_file_bytes(payload):
    from safetensors.torch import load

    return list(load(payload.files["adapter_model.safetensors"]))


def test_mtp_loss_refused_without_mtp_tensors(tiny_dir, tmp_path):
    from rl.train.trainer import PolicyTrainer

    with pytest.raises(ValueError, match="actor.mtp_loss_scale=0.1: .* stores no MTP layer weights"):
        PolicyTrainer(rl_cfg(tiny_dir, actor={"mtp_loss_scale": 0.1}))


def test_vllm_mtp_speculative_settings(tiny_mtp_dir, tiny_dir):
    from rl.rollout.draft import mtp_speculative_config

    c = json.loads((Path(tiny_mtp_dir) / "config.json").read_text())
    assert mtp_speculative_config(c, 2, tiny_mtp_dir) == {"method": "mtp", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="mtp_draft_tokens=1: .*num_nextn_predict_layers=0"):
        mtp_speculative_config(json.loads((Path(tiny_dir) / "config.json").read_text()), 1, tiny_dir)


def test_glm5_rl_mtp_loss_without_mtp_tensors_is_a_one_line_error(tiny_dir, tmp_path):
    """Refused before Ray or any worker starts: exit 2, one line naming the field and folder, no run folder."""
    import contextlib
    import io

    from recipes.main import main

    out = tmp_path / "rl"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["rl", f"model.hf_dir={tiny_dir}", f"trainer.out={out}", "actor.mtp_loss_scale=0.1",
                   "wandb.mode=disabled"])
    lines = err.getvalue().strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("glm5 rl: error: actor.mtp_loss_scale=0.1: "), lines
    assert tiny_dir in lines[0] and not out.exists()


def _drafted_case(trainer, seed: int = 0, hit: float = 0.7) -> dict:
    """A policy adapter (every adapted module, full tensors, MTP layer's included) and a batch of 4
    prompts × 2 responses in which each response token after the first is, with probability ``hit``,
    the MTP head's draft for it under that adapter (else random): so ``rollout/mtp_accept`` is far
    from 0 (random tokens would give ~1/vocab). Built position by position: the draft of token t
    (from position t-2 and token t-1) does not depend on tokens t and later."""
    from glm5_mcore.lora.apply import lora_layers
    from tests.workers.rl_mtp_check import load_case

    g = torch.Generator().manual_seed(seed)
    adapter = {}
    for _, _, lora in lora_layers(trainer.model):
        a, b = lora.full("default")
        adapter[lora.module_name] = (torch.randn(a.shape, generator=g) / a.shape[1] ** 0.5,
                                     torch.randn(b.shape, generator=g) * 0.1)
    V = trainer.glm5.vocab_size
    prompts = [torch.randint(3, V, (5 + p,), generator=g).tolist() for p in range(4)]
    case = {"adapter": adapter, "prompts": [prompts[i // 2] for i in range(8)],
            "responses": [torch.randint(3, V, (6 + i % 4,), generator=g).tolist() for i in range(8)],
            "scores": torch.tensor([1.0, 0.0] * 4)}
    batch = load_case(trainer, case)
    budget, trainer.cfg.actor.micro_batch_tokens = trainer.cfg.actor.micro_batch_tokens, 4096  # one forward per k
    for k in range(1, max(len(r) for r in case["responses"])):
        for mb in trainer._micro_batches(batch, list(range(batch.size))):
            with torch.no_grad():
                draft = _mtp_logits(trainer, mb, train=False)[0].argmax(-1)
            for j, i in enumerate(mb.rows):
                if k < len(case["responses"][i]) and float(torch.rand((), generator=g)) < hit:
                    case["responses"][i][k] = int(draft[int(mb.pos[j, k]) + 1 - 2])
        batch = load_case(trainer, case)
    trainer.cfg.actor.micro_batch_tokens = budget
    return case


@pytest.mark.slow
def test_mtp_loss_and_accept_at_tp2_and_dp2ep2_equal_one_rank(tiny_mtp_dir, tmp_path):
    """``mtp/loss`` and ``rollout/mtp_accept`` of one RL step (and the old log-probs) at TP 2 (vocab-parallel
    MTP logits, sequence parallel) and at DP 2 × EP 2 (rows split, acceptance counts summed over DP)
    equal one rank's (fp32, ≤ 1e-5); one torchrun launch, gloo."""
    import os
    import subprocess
    import sys
    import time

    from rl.train.trainer import PolicyTrainer
    from tests.workers.rl_mtp_check import load_case, measure, mtp_cfg

    cfg = mtp_cfg(tiny_mtp_dir)
    ref_trainer = PolicyTrainer(cfg)
    t0 = time.perf_counter()
    case = _drafted_case(ref_trainer)
    ref = measure(ref_trainer, cfg, load_case(ref_trainer, case))
    t1 = time.perf_counter()
    torch.save(case, tmp_path / "case.pt")
    torchrun("rl_mtp_check.py", tiny_mtp_dir, tmp_path / "case.pt", tmp_path / "out.pt")
    res = torch.load(tmp_path / "out.pt")
    print(f"\none rank {t1 - t0:.1f}s, torchrun {time.perf_counter() - t1:.1f}s")
    print("mtp multi-rank:", {"one": {k: float(ref[k]) for k in ("mtp_loss", "mtp_accept")},
                                **{n: {k: float(v[k]) for k in ("mtp_loss", "mtp_accept")} for n, v in res.items()}})
    assert 0.3 < float(ref["mtp_accept"]) < 0.95 and float(ref["mtp_loss"]) > 0, ref
    assert set(res) == {"tp2", "dp2ep2"}
    for name, got in res.items():
        for k in ("mtp_loss", "mtp_accept"):
            assert abs(float(got[k]) - float(ref[k])) <= 1e-5, (name, k, float(got[k]), float(ref[k]))
        assert float((got["old_log_probs"] - ref["old_log_probs"]).abs().max()) <= 1e-5, name


@pytest.mark.parametrize("merge", [False, True])
def test_vllm_push_sends_the_mtp_layer_to_the_draft_model(mtp_setup, tiny_mtp_dir, tmp_path, merge):
    """Drafting (``mtp_draft_tokens``): a push merges the MTP layer's adapter into vLLM's draft model
    (``reload_draft``, HF names ``model.layers.{L}.*``, whole vLLM modules) — the trainer's merged MTP
    weights (≤ 1e-6) — in LoRA mode too, where the LoRARequest's adapter carries no MTP tensor (vLLM's
    LoRA never reaches the draft); the decoder's tensors go to ``reload`` only (merged mode); the base
    model again restores the draft. Not drafting: nothing of the MTP layer is sent."""
    from glm5_mcore.checkpoint.hf_io import HFCheckpoint

    cfg, trainer, batch = mtp_setup
    L = trainer.glm5.num_hidden_layers
    payload = trainer.export_adapter(7)  # the MTP loss is on: the MTP layer's adapter travels with it
    want = trainer_merged_mtp(trainer)
    e = recording_engine(tiny_mtp_dir, tmp_path / "e", merge, drafts=True)
    e.load_adapter(payload)
    draft = {h: t for m, ts in e.server.calls if m == "reload_draft" for h, t in ts.items()}
    decoder = {h: t for m, ts in e.server.calls if m == "reload" for h, t in ts.items()}
    assert draft and all(h.startswith(f"model.layers.{L}.") for h in draft)
    assert not any(h.startswith(f"model.layers.{L}.") for h in decoder)
    # LoRA mode: the decoder's adapter is the LoRARequest, but for the MLA up-projection, merged (issue 28 B1)
    assert merge or (decoder and all(".self_attn.kv_b_proj." in h for h in decoder))
    assert set(want) <= set(draft) and max(float((draft[h] - w).abs().max()) for h, w in want.items()) <= 1e-6
    # whole vLLM modules: fused q_a + kv_a, gate + up come as pairs
    for a, b in (("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa"),
                 ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj")):
        assert {f"model.layers.{L}.{x}.weight" for x in (a, b)} <= set(draft)
    if not merge:
        (added,) = [a["tensors"] for m, a in e.server.calls if m == "add_adapter"]
        assert added and not any(f"model.layers.{L}." in k for k in added)
    e.server.calls.clear()
    e.load_adapter(None)  # base model again: the draft model's pushed tensors back to base
    base = HFCheckpoint(tiny_mtp_dir)
    back = {h: t for m, ts in e.server.calls if m == "reload_draft" for h, t in ts.items()}
    assert set(back) == set(draft) and all(torch.equal(t, base.get(h)) for h, t in back.items())
    off = recording_engine(tiny_mtp_dir, tmp_path / "e", merge, drafts=False)
    off.load_adapter(payload)
    assert not any(m == "reload_draft" or any(h.startswith(f"model.layers.{L}.") for h in ts)
                   for m, ts in off.server.calls)


def test_vllm_cpu_drafting_refuses_sampling_at_temperature(tiny_mtp_dir, tmp_path):
    """vLLM-CPU's speculative sampling at T > 0 returns wrong log-probs (measured: uniform / NaN after the
    first token), which IcePop would take for the policy's: refused, naming why, before vLLM is asked."""
    from rl.rollout.base import Request, SamplingParams

    e = recording_engine(tiny_mtp_dir, tmp_path, merge=True, drafts=True)
    e.device = "cpu"
    with pytest.raises(ValueError, match="speculative sampling returns wrong processed log-probs at temperature"):
        e.generate([Request((0, 0), [3, 4], 1)], SamplingParams(0.8, 1.0, 4, ()))
    assert e.server.calls == []

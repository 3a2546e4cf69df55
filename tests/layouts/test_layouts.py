"""Every layout equals one rank, declared once: ``MATRIX`` lists, per check, the tiny model it runs on
and the layouts (with the world size each needs) that must give the one-rank result. All cases of a
world size run in one torchrun launch (``tests/workers/layout_matrix.py``, re-laying out between
cases); the one-rank references are computed in this process by the same functions. A case in
``REFERENCE`` must give another entry's one-rank result instead (recompute: that of no recompute).

A vocabulary TP 2 does not divide (129) is padded (``glm5_mcore.model.vocab``): its logits, log-probs, SFT losses
and RL trainer log-probs at TP 2 equal one rank's, and the TP 2 SFT run's adapter exported as PEFT passes
``glm5 parity --tp 2``.

Not in the matrix because their worker already runs several layouts in one launch: the indexer loss
(``tests/model/test_indexer_loss.py``: DP 2, TP 2, CP 2), optimizer-state resume
(``tests/training/test_optimizer_state.py``: DP 2, TP 2), RL with MTP (``tests/rl/test_mtp.py``: TP 2,
DP 2 × EP 2). The ``glm5 sft`` CLI under torchrun is run by ``tests/recipes/test_hydra_cli.py`` and the
docs' command blocks (``tests/test_docs.py``)."""

import json
import math

import pytest
import torch

from glm5_mcore.mcore_settings import ParallelConfig
from glm5_mcore.lora.state import read_adapter_state

from tests.support.launch import torchrun
from tests.workers.layout_matrix import CHECKS

SFT_LORA = ("lora.rank=4",
            "lora.targets=[linear_q_up_proj,linear_kv_up_proj,linear_proj,linear_fc1,linear_fc2,experts.linear_fc1]")
MATRIX = {  # name: (check, tiny model fixture, check kwargs, [(layout, world size)])
    "logits": ("logits", "tiny_share_dir", {},
               [(dict(tp=2), 2), (dict(ep=2), 2), (dict(cp=2), 2), (dict(tp=2, ep=2), 4)]),
    "lora_steps": ("lora_steps", "tiny_dir", {}, [(dict(tp=2), 2), (dict(ep=2), 2), (dict(tp=2, ep=2), 2)]),
    # LoRA on the grouped experts (TEGroupedMLP, lora.grouped) gives the one-rank SequentialMLP run's
    "lora_steps_grouped": ("lora_steps", "tiny_dir", {"grouped": True}, [(dict(ep=2), 2), (dict(tp=2), 2)]),
    # LoRA on the routed experts under expert TP (both expert layouts): logits, grads, norms, two steps
    "lora_grads": ("lora_grads", "tiny_dir", {}, [(dict(etp=2), 2), (dict(tp=2, etp=2), 2)]),
    "lora_grads_grouped": ("lora_grads", "tiny_dir", {"grouped": True}, [(dict(etp=2), 2), (dict(tp=2, etp=2), 2)]),
    "logprobs": ("logprobs", "tiny_dir", {}, [(dict(tp=2), 2)]),
    # PP 2 x CP 2 (issue 28 A4): Megatron's schedule sizes the P2P buffers from ``seq_length // cp``, so the recipe
    # passes the sequence length before the CP split (the split one hung or broke a shape between the stages)
    "sft_losses": ("sft_losses", "tiny_dir", {"extra": SFT_LORA},
                   [(dict(tp=2), 2), (dict(ep=2), 2), (dict(tp=2, ep=2), 2), (dict(pp=2), 2), (dict(cp=2), 2),
                    (dict(etp=2), 2), (dict(pp=2, cp=2), 4)]),
    # the last stage's MTP embedding copy is synced on CPU (cpu_compat, language_module.py:307)
    # SFT with LoRA on the grouped experts (TEGroupedMLP, lora.grouped) gives the one-rank SequentialMLP run's losses
    "sft_losses_grouped": ("sft_losses", "tiny_dir", {"extra": (*SFT_LORA, "model.moe_grouped_gemm=true")},
                           [(dict(pp=2), 2), (dict(ep=2), 2)]),
    "sft_losses_mtp": ("sft_losses", "tiny_mtp_dir", {"rows": 32}, [(dict(pp=2), 2)]),
    # a vocabulary of 129 (and the MTP layer): TP 2 pads it to 130 rows, the padded logits masked (model.vocab)
    "logits_odd_vocab": ("logits", "tiny_odd_dir", {}, [(dict(tp=2), 2)]),
    "logprobs_odd_vocab": ("logprobs", "tiny_odd_dir", {}, [(dict(tp=2), 2)]),
    "sft_losses_odd_vocab": ("sft_losses", "tiny_odd_dir", {"extra": SFT_LORA}, [(dict(tp=2), 2)]),
    "rl_logprobs_odd_vocab": ("rl_logprobs", "tiny_odd_dir", {}, [(dict(tp=2), 2)]),
    # activation recompute on the CPU (cpu_compat.checkpoint_rng) with LoRA dropout, IndexShare under 1F1B
    "recompute": ("recompute_grads", "tiny_share_pp_dir", {}, [(dict(tp=2), 2), (dict(pp=2), 2)]),
    "sft_share": ("sft_losses", "tiny_share_pp_dir", {"extra": SFT_LORA}, []),  # the reference of the next two
    "sft_share_full": ("sft_losses", "tiny_share_pp_dir", {"extra": (*SFT_LORA, "train.recompute=full")},
                       [(dict(pp=2), 2)]),
    "sft_share_selective": ("sft_losses", "tiny_share_pp_dir", {"extra": (*SFT_LORA, "train.recompute=selective")},
                            [(dict(pp=2), 2)]),
    # a checkpoint storing its base in FP8 (16x16 blocks), loaded as stored: TP shards and EP experts of the grid
    "fp8_ckpt": ("fp8_ckpt_logits", "tiny_fp8_ckpt", {}, [(dict(tp=2, ep=2), 2)]),
    # a dense checkpoint (hf-to-mcore --dequantize-fp8 of that release) into model.base_dtype=fp8: quantized from the
    # whole HF tensors at every layout, so one rank, TP 2 and ETP 2 hold the release's bytes and train alike
    "fp8_dense_ckpt": ("fp8_ckpt_logits", "tiny_fp8_dense_ckpt", {}, [(dict(tp=2), 2), (dict(etp=2), 2)]),
    "fp8_dense_sft": ("sft_losses", "tiny_fp8_dense_ckpt",
                      {"source": "model.ckpt", "extra": (*SFT_LORA, "model.base_dtype=fp8")},
                      [(dict(tp=2), 2), (dict(etp=2), 2)]),
}
REFERENCE = {"sft_share_full": "sft_share", "sft_share_selective": "sft_share", "lora_steps_grouped": "lora_steps",
             "lora_grads_grouped": "lora_grads", "sft_losses_grouped": "sft_losses"}
"""Cases whose layouts must give another entry's one-rank result: recompute equals no recompute, grouped experts
equal sequential ones."""


@pytest.fixture(scope="module")
def tiny_fp8_ckpt(tmp_path_factory):
    """``hf-to-mcore`` of a tiny FP8 folder (16x16 blocks, non-canonical scales): its base stored in FP8."""
    from glm5_mcore.convert.hf_to_mcore import hf_to_mcore

    from tests.support.helpers import fp8_folders

    root = tmp_path_factory.mktemp("fp8ck")
    fp8, _ = fp8_folders(root, block=16, scale_by=4.0)
    return str(hf_to_mcore(fp8, root / "ckpt", progress=False))


@pytest.fixture(scope="module")
def tiny_fp8_dense_ckpt(tmp_path_factory):
    """``hf-to-mcore --dequantize-fp8`` of a tiny FP8 folder (16x16 blocks, canonical scales, so quantizing its
    dequantized tensors whole gives its bytes back): a dense checkpoint whose ``hf/config.json`` keeps the
    release's ``quantization_config``."""
    from glm5_mcore.convert.hf_to_mcore import hf_to_mcore

    from tests.support.helpers import fp8_folders

    root = tmp_path_factory.mktemp("fp8dense")
    fp8, _ = fp8_folders(root, block=16)
    return str(hf_to_mcore(fp8, root / "ckpt", progress=False, dequantize_fp8=True))


def _id(check, layout, world):
    return f"{check}-" + "-".join(f"{k}{v}" for k, v in layout.items()) + f"-w{world}"


CASES = [(name, layout, world) for name, (_, _, _, layouts) in MATRIX.items() for layout, world in layouts]


@pytest.fixture(scope="module")
def launched(request, tmp_path_factory):
    """{case id: result} of every case, one torchrun launch per world size."""
    root = tmp_path_factory.mktemp("layouts")
    results = {}
    for world in sorted({w for _, _, w in CASES}):
        cases = [{"id": _id(n, lay, w), "check": MATRIX[n][0], "hf_dir": request.getfixturevalue(MATRIX[n][1]),
                  "kwargs": MATRIX[n][2], **lay} for n, lay, w in CASES if w == world]
        (root / f"w{world}.json").write_text(json.dumps(cases))
        torchrun("layout_matrix.py", root / f"w{world}.json", root / f"w{world}.pt", nproc=world, timeout=1200)
        results.update(torch.load(root / f"w{world}.pt", weights_only=False))
    return results


@pytest.fixture(scope="module")
def one_rank(request, tmp_path_factory):
    """{name: result at one rank}, computed in this process."""
    from glm5_mcore.model.parallel import init_parallel

    root = tmp_path_factory.mktemp("one_rank")
    init_parallel(ParallelConfig())
    return {n: CHECKS[check](request.getfixturevalue(fixture), ParallelConfig(), str(root / n), **kwargs)
            for n, (check, fixture, kwargs, _) in MATRIX.items() if n not in REFERENCE}


def _logits(got, ref):
    diff = (got["logits"] - ref["logits"]).abs().max()
    assert diff <= 1e-5, float(diff)


def _lora_steps(got, ref):
    assert ref["losses"][3] < ref["losses"][2] < ref["losses"][1] < ref["losses"][0], ref  # each update lowers it
    rel = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], ref["losses"]))
    assert rel <= 1e-6, (got["losses"], ref["losses"])
    adapter, ref_adapter = read_adapter_state(got["adapter"]), read_adapter_state(ref["adapter"])  # layout-free
    assert sorted(adapter.A) == sorted(ref_adapter.A)
    for k in ref_adapter.A:
        assert torch.allclose(adapter.delta(k), ref_adapter.delta(k), rtol=1e-4, atol=1e-6), k


def _rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def _lora_grads(got, ref):
    """Expert TP 2 gives one rank's logits, losses and grad norms (≤ 1e-6 relative: each replicated factor counted
    once) and every adapter gradient, each tensor within 5e-6 of its largest element at step 1 (the fp32
    reduction-order floor: the MLA adapters, which ETP does not touch, differ by 1.9e-6) and 5e-5 at step 2
    (after an SGD step of lr 0.1: 1.7e-5 seen). With TP 2 too (ETP = TP, the GPU presets' layout) the dense
    adapters' own TP reductions set the floor: a dense fc1 gradient 1.2e-5 apart at step 1 (the experts' 3.7e-6),
    8.4e-5 at step 2, the logits 1.9e-6, the step-2 norm 2.5e-6. Step 2's loss and norm follow the SGD step, so
    they get the adapters' after-step tolerance (1e-5; ETP 2 alone gave the step-2 norm 4.1e-6 apart). Without the expert-TP all-reduce of the
    replicated A (fc1) / B (fc2) gradients: the experts' fc1 A gradients 1.38 apart at step 1, the step-2 loss
    0.14 %, the norm 12.53 for 12.73."""
    close, step1, step2, after = (1e-6, 5e-6, 5e-5, 1e-5) if got["tp"] == 1 else (5e-6, 2e-5, 2e-4, 5e-5)
    assert _rel(got["logits"], ref["logits"]) <= close
    for k in ("losses", "norms"):
        assert len(got[k]) == len(ref[k]) == 2, (k, got[k])
        for step, tol in enumerate((close, after)):  # step 2 follows an SGD step: the floor grows with it
            rel = abs(got[k][step] - ref[k][step]) / ref[k][step]
            assert rel <= tol, (k, step, got[k], ref[k])
    for step, tol in enumerate((step1, step2)):
        g, r = got["grads"][step], ref["grads"][step]
        assert sorted(g) == sorted(r) and any(".experts.local_experts." in m for m in r)
        worst = max((max(_rel(g[m][0], a), _rel(g[m][1], b)), m) for m, (a, b) in r.items())
        assert worst[0] <= tol, (step, worst)
    worst = max((max(_rel(got["adapter"][m][0], a), _rel(got["adapter"][m][1], b)), m)
                for m, (a, b) in ref["adapter"].items())
    assert worst[0] <= after, worst


def _logprobs(got, ref=None):
    assert (got["lp"] - got["ref_lp"]).abs().max() <= 1e-5 and (got["ent"] - got["ref_ent"]).abs().max() <= 1e-5
    assert got["lp"].shape == (2, 16) and (got["lp"] < 0).all()


def _sft_losses(got, ref):
    # three steps see three different batches, so their losses are not ordered; that the recipe learns is
    # test_tiny_sft_lowers_train_and_validation_loss's job, this check's is that every layout gives one rank's
    print("sft losses:", {"layout": got["losses"], "one rank": ref["losses"]})
    assert len(ref["losses"]) == 3 and all(math.isfinite(x) for x in ref["losses"])
    assert max(abs(a - b) / b for a, b in zip(got["losses"], ref["losses"])) <= 1e-6, (got, ref)


def _rl_logprobs(got, ref):
    mask = ref["mask"].bool()
    for k in ("old", "ref", "after"):
        assert torch.isfinite(got[k][mask]).all(), k
        diff = float((got[k] - ref[k])[mask].abs().max())
        assert diff <= 1e-5, (k, diff)
    assert (ref["old"] - ref["ref"])[mask].abs().max() > 1e-3  # the policy adapter is not the identity
    assert (ref["after"] - ref["old"])[mask].abs().max() > 1e-4  # and the update moved it
    assert ref["metrics"]["actor/entropy"] > 0 and ref["metrics"]["actor/updates_skipped"] == 0, ref["metrics"]
    # the pushed adapter: the same PEFT tensors, none of them vocabulary-sized (the padding stays in the trainer)
    assert sorted(got["pushed"]) == sorted(ref["pushed"]) and got["pushed"]
    for k, t in ref["pushed"].items():
        assert got["pushed"][k].shape == t.shape and 129 not in t.shape and 130 not in t.shape, k
        # two Adam steps of lr 1e-3 moved each element by up to 2e-3; fp32 reduction order moves Adam's
        # near-zero-gradient elements by a few 1e-6 (4.3e-6, 1.12e-5 seen in CI): 3e-5 is 1.5 % of a step's
        # move, a wrong shard or a dropped gradient is ~1e-3
        assert float((got["pushed"][k] - t).abs().max()) <= 3e-5, k
    assert set(got["metrics"]) == set(ref["metrics"])
    for k, v in ref["metrics"].items():
        if k.startswith("actor/micro_batch"):  # how the tokens were packed: TP 2 pads each pack for SP
            continue
        assert got["metrics"][k] == pytest.approx(v, rel=1e-5, abs=1e-7), (k, v, got["metrics"][k])


def _recompute_grads(got, ref=None):
    """Selective and full recompute at this layout: the losses and every adapter gradient of no recompute
    (≤ 1e-6, relative to the largest gradient), with dropout drawn; printed: the figures."""
    print("recompute:", {"grad_diff": got["grad_diff"], "grad_max": got["grad_max"]})
    assert got["grad_max"] > 0 and all(math.isfinite(x) for x in got["losses"][None])
    for mode in ("selective", "full"):
        assert got["grad_diff"][mode] <= 1e-6, (mode, got["grad_diff"])
        assert max(abs(a - b) / b for a, b in zip(got["losses"][mode], got["losses"][None])) <= 1e-6, got["losses"]


def _fp8_ckpt_logits(got, ref):
    """Every FP8 weight of the rank holds the release's bytes and scales (checked in the worker against
    ``load_hf_weights`` of the HF origin); under EP only this rank's share of the experts, else all of them."""
    print("fp8 base:", {"weights equal to the release's": got["fp8"], "of": ref["fp8"], "ep": got["ep"]})
    assert 0 < got["fp8"] < ref["fp8"] if got["ep"] > 1 else got["fp8"] == ref["fp8"] > 0, (got["fp8"], ref["fp8"])
    _logits(got, ref)


EQUAL = {"logits": _logits, "lora_steps": _lora_steps, "lora_grads": _lora_grads, "logprobs": _logprobs, "sft_losses": _sft_losses,
         "rl_logprobs": _rl_logprobs, "recompute_grads": _recompute_grads, "fp8_ckpt_logits": _fp8_ckpt_logits}


@pytest.mark.slow
@pytest.mark.parametrize("name,layout,world", CASES, ids=[_id(*c) for c in CASES])
def test_layout_equals_one_rank(name, layout, world, launched, one_rank):
    EQUAL[MATRIX[name][0]](launched[_id(name, layout, world)], one_rank[REFERENCE.get(name, name)])


@pytest.mark.slow
def test_tp2_lora_export_of_an_odd_vocabulary_loads_in_peft_and_passes_parity(launched, tiny_odd_dir, tmp_path):
    """The adapter the TP 2 SFT run above trained on a vocabulary of 129 (130 rows, one padded), exported as
    HF PEFT (``glm5 lora export``): peft loads it into transformers' model with the original vocabulary (no
    missing or unexpected key, no vocabulary-sized tensor), and ``glm5 parity --tp 2 --adapter`` agrees."""
    from safetensors.torch import load_file

    from glm5_mcore.convert.lora_export import export_checkpoint_adapter
    from tests.support.helpers import peft_model
    from tests.support.launch import glm5, last_json

    run = launched[_id("sft_losses_odd_vocab", dict(tp=2), 2)]["run"]
    peft = export_checkpoint_adapter(run, tmp_path / "peft")
    tensors = load_file(str(peft / "adapter_model.safetensors"))
    assert tensors and all(129 not in t.shape and 130 not in t.shape for t in tensors.values())
    assert max(float(t.abs().max()) for k, t in tensors.items() if "lora_B" in k) > 0  # trained, not the init
    pm, unexpected, missing = peft_model(tiny_odd_dir, peft)
    assert not unexpected and not missing and pm.get_base_model().lm_head.weight.shape == (129, 64)
    rep = last_json(glm5("parity", "--hf-dir", tiny_odd_dir, "--adapter", peft, "--tp", "2", nproc=2).stdout)
    assert rep["tp"] == 2 and rep["vocab_rows"] == 130 and rep["shape"] == [2, 32, 129], rep
    assert rep["max_abs"] <= 1e-5 and rep["topk_agree"] == 1.0 and rep["router_agree"] == 1.0, rep


def test_one_rank_token_logprobs_equal_the_full_vocabulary(one_rank):
    _logprobs(one_rank["logprobs"])


def test_one_rank_recompute_equals_no_recompute(one_rank):
    """Was: refused on the CPU ("needs CUDA: activation recompute restores the CUDA RNG state"); with it, full
    recompute of a LoRA model failed (no input of Megatron's checkpoint required grad) and selective recompute
    took another DSA core in its replay than the forward had (with LoRA dropout: gradients 2.6 apart)."""
    _recompute_grads(one_rank["recompute"])

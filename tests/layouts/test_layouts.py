"""Every layout equals one rank, declared once: ``MATRIX`` lists, per check, the tiny model it runs on
and the layouts (with the world size each needs) that must give the one-rank result. All cases of a
world size run in one torchrun launch (``tests/workers/layout_matrix.py``, re-laying out between
cases); the one-rank references are computed in this process by the same functions.

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
    "logprobs": ("logprobs", "tiny_dir", {}, [(dict(tp=2), 2)]),
    "sft_losses": ("sft_losses", "tiny_dir", {"extra": SFT_LORA},
                   [(dict(tp=2), 2), (dict(ep=2), 2), (dict(tp=2, ep=2), 2), (dict(pp=2), 2), (dict(cp=2), 2)]),
    # the last stage's MTP embedding copy is synced on CPU (cpu_compat, language_module.py:307)
    "sft_losses_mtp": ("sft_losses", "tiny_mtp_dir", {"rows": 32}, [(dict(pp=2), 2)]),
    # a checkpoint storing its base in FP8 (16x16 blocks), loaded as stored: TP shards and EP experts of the grid
    "fp8_ckpt": ("fp8_ckpt_logits", "tiny_fp8_ckpt", {}, [(dict(tp=2, ep=2), 2)]),
}


@pytest.fixture(scope="module")
def tiny_fp8_ckpt(tmp_path_factory):
    """``hf-to-mcore`` of a tiny FP8 folder (16x16 blocks, non-canonical scales): its base stored in FP8."""
    from glm5_mcore.convert.hf_to_mcore import hf_to_mcore

    from tests.support.helpers import fp8_folders

    root = tmp_path_factory.mktemp("fp8ck")
    fp8, _ = fp8_folders(root, block=16, scale_by=4.0)
    return str(hf_to_mcore(fp8, root / "ckpt", progress=False))


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
            for n, (check, fixture, kwargs, _) in MATRIX.items()}


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


def _logprobs(got, ref=None):
    assert (got["lp"] - got["ref_lp"]).abs().max() <= 1e-5 and (got["ent"] - got["ref_ent"]).abs().max() <= 1e-5
    assert got["lp"].shape == (2, 16) and (got["lp"] < 0).all()


def _sft_losses(got, ref):
    # three steps see three different batches, so their losses are not ordered; that the recipe learns is
    # test_tiny_sft_lowers_train_and_validation_loss's job, this check's is that every layout gives one rank's
    assert len(ref["losses"]) == 3 and all(math.isfinite(x) for x in ref["losses"])
    assert max(abs(a - b) / b for a, b in zip(got["losses"], ref["losses"])) <= 1e-6, (got, ref)


def _fp8_ckpt_logits(got, ref):
    assert 0 < got["fp8"] < ref["fp8"], (got["fp8"], ref["fp8"])  # this rank's share of the experts, each as stored
    _logits(got, ref)


EQUAL = {"logits": _logits, "lora_steps": _lora_steps, "logprobs": _logprobs, "sft_losses": _sft_losses,
         "fp8_ckpt_logits": _fp8_ckpt_logits}


@pytest.mark.slow
@pytest.mark.parametrize("name,layout,world", CASES, ids=[_id(*c) for c in CASES])
def test_layout_equals_one_rank(name, layout, world, launched, one_rank):
    EQUAL[MATRIX[name][0]](launched[_id(name, layout, world)], one_rank[name])


def test_one_rank_token_logprobs_equal_the_full_vocabulary(one_rank):
    _logprobs(one_rank["logprobs"])

"""TP=2, EP=2 and CP=2 (gloo, torchrun) give the logits of one rank, with the expected shards."""


import pytest
from safetensors.torch import load_file

from tests.support.launch import torchrun



def _run(hf_dir, tp, ep, cp, out, nproc):
    torchrun("dist_check.py", hf_dir, tp, ep, cp, out, nproc=nproc)
    return load_file(out)["logits"]


@pytest.fixture(scope="module")
def one_rank(tiny_share_dir, tmp_path_factory):
    return _run(tiny_share_dir, 1, 1, 1, tmp_path_factory.mktemp("l") / "one.safetensors", 1)


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep,cp", [(2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2, 1)])
def test_layout_gives_one_rank_logits(tp, ep, cp, one_rank, tiny_share_dir, tmp_path):
    got = _run(tiny_share_dir, tp, ep, cp, tmp_path / "l.safetensors", max(tp * cp, ep))
    diff = (got - one_rank).abs().max()
    assert diff <= 1e-5, float(diff)

"""TP=2, EP=2 and CP=2 (gloo, torchrun) give the logits of one rank, with the expected shards."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

HERE = Path(__file__).resolve().parent


def _run(hf_dir, tp, ep, cp, out, nproc):
    env = {k: v for k, v in os.environ.items()  # the pytest process holds its own process group
           if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parents[1]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--standalone", str(HERE.parent / "workers" / "dist_check.py"),
           hf_dir, str(tp), str(ep), str(cp), str(out)]
    if nproc == 1:
        cmd = [sys.executable, str(HERE.parent / "workers" / "dist_check.py"), hf_dir, str(tp), str(ep), str(cp), str(out)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
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

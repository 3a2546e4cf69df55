"""Two Ray "nodes" on this machine (``ray start --head`` + ``ray start --address`` with resources of its
own, every node at 127.0.0.1; Ray's driver resolves a 127.0.0.1 bootstrap address to this machine's own
interface address, services.py:799): the RL job's trainer ranks spread over both as the placement group says (one
``torch.distributed`` group across the nodes), engines colocated in their rank's bundle or, separate,
wherever Ray has room. The test stops exactly the Ray processes it started (their process groups)."""

import os
import signal
import socket
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs) -> None:
    for p in reversed(procs):
        try:
            os.killpg(p.pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
    deadline = time.time() + 30
    for p in procs:
        try:
            p.wait(max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)  # whatever of its group is left (raylet, workers)
        except ProcessLookupError:
            pass


@pytest.fixture
def two_nodes(tmp_path):
    import ray

    ray.shutdown()
    port = _free_port()
    # no token auth: the driver of this test is the cluster's only client (Ray 2.60's `ray start` turns it on)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0",
           "RAY_AUTH_MODE": "disabled"}
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "2", "--num-gpus", "0", "--block",
              "--disable-usage-stats"]
    # its own temp dir: `ray start --head` records itself there (ray_current_cluster), where a plain
    # ray.init() of another job on this machine would otherwise find and join it
    temp = tempfile.mkdtemp(prefix="rn", dir="/tmp")
    procs = [subprocess.Popen([RAY, "start", "--head", "--port", str(port), "--include-dashboard", "false",
                               "--temp-dir", temp,
                               "--resources", '{"node_a": 1}', *common], env=env, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=open(tmp_path / "head.log", "w"))]
    address = f"127.0.0.1:{port}"
    try:
        for _ in range(120):  # the head's GCS up
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.5)
        procs.append(subprocess.Popen([RAY, "start", "--address", address, "--resources", '{"node_b": 1}', *common],
                                      env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                                      stderr=open(tmp_path / "worker.log", "w")))
        ray.init(address=address, log_to_driver=False)
        for _ in range(120):
            if len([n for n in ray.nodes() if n["Alive"]]) == 2:
                break
            time.sleep(0.5)
        nodes = {next(k for k in n["Resources"] if k.startswith("node_")): n["NodeID"] for n in ray.nodes() if n["Alive"]}
        ray.shutdown()
        assert sorted(nodes) == ["node_a", "node_b"], (tmp_path / "worker.log").read_text()[-2000:]
        assert not os.path.exists("/tmp/ray/ray_current_cluster") or f":{port}" not in open(
            "/tmp/ray/ray_current_cluster").read()  # nobody else's ray.init() finds this cluster
        yield address, nodes
    finally:
        ray.shutdown()
        _stop(procs)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_rl_job_over_two_ray_nodes_colocated_and_separate(tiny_dir, tmp_path, two_nodes):
    import ray

    from rl.driver import run
    from tests.rl.test_colocate import rl_cfg

    address, nodes = two_nodes
    both = set(nodes.values())
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = str(REPO)
    try:
        out = {}
        for mode in ("separate", "colocated"):
            cfg = rl_cfg(tiny_dir, tmp_path / mode, ray={"address": address, "placement_strategy": "STRICT_SPREAD"},
                         trainer={"world_size": 2, "steps": 1}, rollout={"num_actors": 2,
                                                                          "colocate": {"enable": mode == "colocated"}})
            out[mode] = run(cfg)
            ray.shutdown()
    finally:
        ray.shutdown()
        os.environ.pop("PYTHONPATH") if before is None else os.environ.update(PYTHONPATH=before)
    for mode, res in out.items():
        pl = res["placement"]
        assert set(pl["trainer"]) == both, (mode, pl)  # STRICT_SPREAD: one rank per node, one gloo group
        assert len(res["history"]) == 1
    co = out["colocated"]["placement"]
    assert co["engines"] == co["trainer"]  # engine i in rank i's bundle, on its node
    assert set(out["separate"]["placement"]["engines"]) <= both
    assert out["colocated"]["history"][0]["actor/pg_loss"] == out["separate"]["history"][0]["actor/pg_loss"]

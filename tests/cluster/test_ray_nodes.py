"""Two Ray "nodes" on this machine (``ray start --head`` + ``ray start --address`` with resources of its
own, every node at 127.0.0.1; Ray's driver resolves a 127.0.0.1 bootstrap address to this machine's own
interface address, services.py:799): the RL job's trainer ranks spread over both as the placement group says (one
``torch.distributed`` group across the nodes), engines colocated in their rank's bundle; the job's driver runs in a process of its own. A failure carries
the tails of the cluster's raylet and worker logs. The test stops exactly the Ray processes it started (their process groups).

It lives in ``tests/cluster/`` so that it runs before every other Ray test of the suite: run after
``tests/rl/test_ray_failures.py::test_trainer_rank_death_ends_the_wait_and_says_the_command_resumes``, the
trainer's first actor is cancelled before it runs ("all references to the actor were removed"), even with
this job's driver and node checks in processes of their own; alone, or first, it passes."""

import json
import math
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

pytestmark = pytest.mark.ray  # all in the one xdist group that runs Ray (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))


def _log_tails(temp: str, n: int = 15) -> str:
    """The last lines of the cluster's raylet and worker error logs: why an actor's process died."""
    logs = sorted(Path(temp).glob("session_*/logs/raylet*.out")) + sorted(Path(temp).glob("session_*/logs/*.err"))
    out = []
    for f in logs:
        lines = [ln for ln in f.read_text(errors="replace").splitlines() if ln.strip()]
        if f.suffix == ".out":
            lines = [ln for ln in lines if " E " in ln or "memory" in ln.lower() or "kill" in ln.lower()]
        if lines:
            out.append(f"--- {f.name}\n" + "\n".join(lines[-n:]))
    return "\n".join(out)[-6000:]


def _alive_nodes(address: str, env: dict) -> dict:
    """{"node_a" | "node_b": node id} of the cluster's alive nodes, asked from a process of its own: the
    pytest process never connects to this cluster (connected after an earlier test's Ray job, its first
    trainer actor was cancelled before it ran)."""
    code = ("import json, ray; ray.init(address=%r, log_to_driver=False); print(json.dumps({next(k for k in "
            "n['Resources'] if k.startswith('node_')): n['NodeID'] for n in ray.nodes() if n['Alive']}))" % address)
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 and r.stdout.strip() else {}


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
    deadline = time.time() + 10
    for p in procs:
        try:
            p.wait(max(1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(p.pid, signal.SIGKILL)  # whatever of its group is left (raylet, workers)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """(address, {"node_a" | "node_b": node id}, temp dir) of a two-node cluster both tests use (each job a
    client of its own, in a process of its own); its start logs under a module temp folder."""
    import ray

    tmp_path = tmp_path_factory.mktemp("two_nodes")

    ray.shutdown()
    port = _free_port()
    # no token auth: the driver of this test is the cluster's only client (Ray 2.60's `ray start` turns it on)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "RAY_DEDUP_LOGS": "0",
           "RAY_AUTH_MODE": "disabled",
           # a loaded 2-core machine: Ray's 60 s for a worker process to register can be too short
           "RAY_worker_register_timeout_seconds": "180"}
    # a small object store each (the job moves KBs): two default stores would book 30 % of memory each
    common = ["--node-ip-address", "127.0.0.1", "--num-cpus", "2", "--num-gpus", "0", "--block",
              "--object-store-memory", str(256 << 20), "--disable-usage-stats"]
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
        for attempt in range(2):  # `ray start` gives up after a fixed 30 s for its raylet (node.py:428): once more
            procs.append(subprocess.Popen([RAY, "start", "--address", address, "--resources", '{"node_b": 1}',
                                           *common], env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                                          stderr=open(tmp_path / f"worker{attempt}.log", "w")))
            for _ in range(120):
                nodes = _alive_nodes(address, env)
                if len(nodes) == 2 or procs[-1].poll() is not None:
                    break
                time.sleep(1)
            if len(nodes) == 2:
                break
        assert sorted(nodes) == ["node_a", "node_b"], (tmp_path / f"worker{attempt}.log").read_text()[-2000:]
        assert not os.path.exists("/tmp/ray/ray_current_cluster") or f":{port}" not in open(
            "/tmp/ray/ray_current_cluster").read()  # nobody else's ray.init() finds this cluster
        yield address, nodes, temp
    finally:
        ray.shutdown()
        _stop(procs)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_rl_job_over_two_ray_nodes_colocated(tiny_dir, tmp_path, two_nodes):
    """Trainer ranks spread one per node (one gloo group across them), engine i in rank i's bundle on
    its node; the driver is a process of its own (``tests/workers/rl_driver.py``). (Colocated equals
    separate on one node: ``tests/rl/test_colocate.py``.)"""
    from tests.rl.test_colocate import rl_dict
    from tests.support.launch import child_env, last_json, torchrun

    address, nodes, temp = two_nodes
    d = rl_dict(tiny_dir, tmp_path / "run", ray={"address": address, "placement_strategy": "STRICT_SPREAD"},
                trainer={"world_size": 2, "steps": 1}, rollout={"num_actors": 2, "colocate": {"enable": True}})
    r = torchrun("rl_driver.py", json.dumps(d), nproc=1, ok=False, timeout=900,
                 env=child_env(PYTHONPATH=str(REPO), WANDB_SILENT="true"))
    assert r.returncode == 0, f"{r.stderr[-3000:]}\n{_log_tails(temp)}"
    res = last_json(r.stdout)
    pl = res["placement"]
    assert set(pl["trainer"]) == set(nodes.values()), pl  # STRICT_SPREAD: one rank per node
    assert pl["engines"] == pl["trainer"], pl  # engine i in rank i's bundle, on its node
    assert len(res["history"]) == 1 and math.isfinite(res["history"][0]["actor/pg_loss"])


@pytest.mark.slow
def test_one_engine_over_both_nodes_bundles(tiny_dir, tmp_path, two_nodes):
    """Item 2: a colocated engine of tensor_parallel_size 2 over a 2-rank trainer spread one rank per node:
    its actor sits in bundle 0 (capturing child tasks, no GPU of its own), and the workers it starts as vLLM's
    Ray executor does (``tests.support.span_engine``: the current placement group, ``VLLM_RAY_BUNDLE_INDICES``,
    ``VLLM_RAY_PER_WORKER_GPUS``) land one per bundle, on both nodes, beside the trainer's share of each."""
    from tests.support.launch import child_env, last_json, run_child

    address, nodes, temp = two_nodes
    r = run_child([sys.executable, REPO / "tests" / "workers" / "engine_span.py", address, tiny_dir, tmp_path / "run"],
                  ok=False, timeout=600, env=child_env(PYTHONPATH=str(REPO)))
    assert r.returncode == 0, f"{r.stderr[-3000:]}\n{_log_tails(temp)}"
    res = last_json(r.stdout)
    placed = res["placed"][0]
    assert placed["bundles"] == [0, 1] and all(w["bundle"] for w in placed["workers"]), placed
    assert [w["node"] for w in placed["workers"]] == res["trainer_nodes"], res  # worker i on bundle i's node
    assert set(res["trainer_nodes"]) == set(nodes.values())  # both nodes
    assert res["driver"] == res["trainer_nodes"][:1]  # the engine's actor in its first bundle
    assert placed["kwargs"]["distributed_executor_backend"] == "ray" and placed["kwargs"]["weight_transport"] == "file"

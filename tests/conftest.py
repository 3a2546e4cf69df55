"""Session fixtures (the tiny checkpoints every module shares), the rule behind ``-m "not slow"`` (a test
that starts a process is marked ``slow``) and the one behind ``-n 2`` (a test that starts Ray is marked
``ray``, and all of them run on one pytest-xdist worker)."""

import os
import subprocess

os.environ.setdefault("OMP_NUM_THREADS", "1")
# Dynamo off from the start (cpu_compat turns it off anyway on CPU, after Megatron's jit.py has wrapped its
# fusions in torch.compile): set before torch is imported, this process and every child it starts (torchrun
# ranks, glm5 CLIs, Ray's workers, vLLM) skip importing the inductor, ~3 s of CPU each.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import pytest
import torch

from tests.support.launch import starts_ray_in

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from glm5_mcore.tiny import write_tiny

    return str(write_tiny(tmp_path_factory.mktemp("ckpt") / "tiny", seed=0))


@pytest.fixture(scope="session")
def tiny_share_dir(tmp_path_factory):
    from glm5_mcore.tiny import write_tiny

    return str(write_tiny(tmp_path_factory.mktemp("ckpt") / "tiny_share", index_share=True, seed=1))


@pytest.fixture(scope="session")
def tiny_share_pp_dir(tmp_path_factory):
    """IndexShare pattern FSFS: under PP 2 each stage starts with a full layer and holds a sharer (FFSF's
    stage 2 would start with one, which has no source on its stage)."""
    from glm5_mcore.tiny import write_tiny

    return str(write_tiny(tmp_path_factory.mktemp("ckpt") / "tiny_share_pp", index_share="FSFS", seed=3))


@pytest.fixture(scope="session")
def tiny_mtp_dir(tmp_path_factory):
    from glm5_mcore.tiny import write_tiny

    return str(write_tiny(tmp_path_factory.mktemp("ckpt") / "tiny_mtp", mtp=True, seed=2))


@pytest.fixture(scope="session")
def tiny_odd_dir(tmp_path_factory):
    """A vocabulary of 129 (with the MTP layer): TP 2 does not divide it, so the model pads it to 130 rows."""
    from glm5_mcore.tiny import write_tiny

    return str(write_tiny(tmp_path_factory.mktemp("ckpt") / "tiny_odd", mtp=True, seed=4, vocab_size=129))


@pytest.fixture(scope="session")
def tiny_converted(tmp_path_factory, tiny_dir):
    """``hf-to-mcore`` of ``tiny_dir`` (CKPT/iter_0000000/model + manifest), made once for the session;
    tests copy it before changing anything in it."""
    from glm5_mcore.convert.hf_to_mcore import hf_to_mcore

    return hf_to_mcore(tiny_dir, tmp_path_factory.mktemp("mc") / "ckpt", progress=False)


@pytest.fixture(scope="session")
def tiny_lora_run(tmp_path_factory, tiny_dir):
    """ROOT with train.jsonl and ROOT/run: one LoRA SFT step of ``tiny_dir`` saved at iteration 1
    (adapters, optimizer, trainer state, manifest), made once for the session; tests copy it before
    changing anything in it."""
    from recipes.sft import run
    from tests.support.sft_setup import count_rows, lora_step_cfg

    root = tmp_path_factory.mktemp("sft")
    count_rows(root / "train.jsonl")
    run(lora_step_cfg(tiny_dir, root))
    return root


@pytest.fixture()
def single_rank():
    from glm5_mcore.mcore_settings import ParallelConfig
    from glm5_mcore.model.parallel import init_parallel

    init_parallel(ParallelConfig())
    yield


RAY_PROGRAMS = ("ray", "raylet", "gcs_server")


def starts_ray(argv: list[str]) -> bool:
    """Whether a child command line starts (or runs a job on) a Ray cluster: Ray's own programs, an RL
    driver (``recipes.main rl``, ``glm5 rl``, ``tests/workers/rl_driver.py``), a shell running one."""
    words = [os.path.basename(str(a)) for a in argv]
    if {"--cfg", "--help", "-h"} & set(words):  # Hydra prints the config or the help, nothing runs
        return False
    return (bool(words) and words[0] in RAY_PROGRAMS) or "rl_driver.py" in words or \
        (("recipes.main" in words or words[:1] == ["glm5"]) and "rl" in words) or \
        (words[:1] in (["bash"], ["sh"]) and starts_ray_in(" ".join(map(str, argv[1:]))))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Every ``ray`` test in one pytest-xdist group (``-n 2 --dist loadgroup``): one worker runs them in
    collection order (``tests/cluster`` first), so two Ray clusters never share the 2 cores, while the other
    worker runs the rest a module at a time, so a module's fixtures (the layout matrix's torchrun launches, a
    module's converted checkpoint) are made once, not once on each worker that gets one of its tests."""
    for item in items:
        ray = item.get_closest_marker("ray") is not None
        item.add_marker(pytest.mark.xdist_group("ray" if ray else item.nodeid.split("::")[0]))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """Under ``--dist loadgroup`` every test id a worker reports must carry its group (xdist 3.8 appends
    ``@group`` after the hook above). On pytest 9.2 that append does nothing (pytest-xdist #1386): nothing
    failed, the groups were silently ignored, Ray tests ran on both workers at once and the layout matrix's
    launches ran twice; hence the ``pytest<9.2`` pin and this check."""
    if node.config.getvalue("dist") == "loadgroup" and ids and not any("@" in i for i in ids):
        raise pytest.UsageError(f"pytest-xdist's --dist loadgroup lost the test groups (pytest-xdist #1386 on "
                                f"pytest {pytest.__version__}; pyproject pins pytest<9.2): e.g. {ids[0]}")


@pytest.fixture(autouse=True)
def spawning_tests_are_marked(request, monkeypatch):
    """A test that starts a Python process (a ``glm5`` CLI, torchrun, a worker script, Ray's or vLLM's
    processes) without the ``slow`` marker fails naming itself, so ``pytest -m "not slow"`` stays the
    quick in-process loop; one that starts Ray (in-process ``ray.init``, an RL driver in a child) without
    the ``ray`` marker fails too, so the xdist grouping above cannot miss a Ray test. Tools the library
    runs in-process (``ldconfig``, ``g++`` for the kernels) are not counted."""
    slow = request.node.get_closest_marker("slow") is not None
    ray = request.node.get_closest_marker("ray") is not None
    if slow and ray:
        yield
        return
    real = subprocess.Popen.__init__

    def guarded(self, args, *a, **k):
        argv = [args] if isinstance(args, (str, os.PathLike)) else list(args)
        exe = os.path.basename(str(argv[0])) if argv else ""
        if not slow and exe.startswith(("python", "torchrun", *RAY_PROGRAMS)):
            raise AssertionError(f"{request.node.nodeid} starts a process ({str(argv)[:120]}) but is not "
                                 "marked @pytest.mark.slow")
        if not ray and starts_ray(argv):
            raise AssertionError(f"{request.node.nodeid} starts Ray ({str(argv)[:120]}) but is not marked "
                                 "@pytest.mark.ray")
        real(self, args, *a, **k)

    monkeypatch.setattr(subprocess.Popen, "__init__", guarded)
    yield

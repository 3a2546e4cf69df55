"""A training run's checkpoints and metrics are never lost (issue 34, classes 1, 2, 3, 11): ``resume=false``
over an earlier run is refused with the folder byte-identical, ``keep_last`` never prunes the checkpoint just
written, a run that fails before its first step leaves ``metrics.jsonl`` byte-identical, the last step is
always saved, and ``glm5 checkpoint verify`` refuses a ``latest`` that no loader accepts."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from recipes.main import main as glm5


def _tree(path) -> dict:
    path = Path(path)
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _rows(path, n=24):
    import random

    r = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            a = [r.randrange(90) for _ in range(r.randrange(3, 10))]
            f.write(json.dumps({"prompt": " ".join(f"w{x}" for x in a),
                                "response": " ".join(f"w{a[0] + k}" for k in range(4))}) + "\n")
    return str(path)


def _cfg(tiny_dir, root, **train):
    from recipes.sft import SFTConfig

    root = Path(root)
    return SFTConfig.from_dict({
        "model": {"hf_dir": tiny_dir},
        "data": {"train": str(root.parent / "train.jsonl"), "micro_batch_tokens": 128, "global_batch_tokens": 128,
                 "max_tokens": 64},
        "optim": {"lr": 1e-3, "decay_style": "constant"}, "lora": {"enabled": True, "rank": 4},
        "train": {"steps": 3, "save_every": 2, "keep_last": 0, "out": str(root), "progress": False, **train},
        "wandb": {"mode": "disabled"}})


@pytest.fixture(scope="module")
def run3(tmp_path_factory, tiny_dir):
    """A 3-step LoRA SFT run with save_every=2: iterations 2 and 3 (the last step, saved anyway)."""
    from recipes.sft import run

    root = tmp_path_factory.mktemp("runs")
    _rows(root / "train.jsonl")
    out = run(_cfg(tiny_dir, root / "run"))
    return root / "run", out


def _copy(run3, tmp_path) -> Path:
    shutil.copy(run3[0].parent / "train.jsonl", tmp_path / "train.jsonl")
    return Path(shutil.copytree(run3[0], tmp_path / "run"))


def test_the_last_step_is_saved_whatever_save_every(run3, tiny_dir, tmp_path):
    """Class 3: steps % save_every != 0 (and save_every=0) still leave the final weights on disk."""
    from glm5_mcore.checkpoint.dist import read_trainer_state
    from glm5_mcore.checkpoint.layout import iterations, latest_iteration
    from recipes.sft import run

    root, out = run3
    assert iterations(root) == [2, 3] and latest_iteration(root) == 3
    assert read_trainer_state(root, 3)["step"] == 3 == out["state"]["step"]
    assert (root / "iter_0000003" / "adapters" / "default").is_dir()
    shutil.copy(root.parent / "train.jsonl", tmp_path / "train.jsonl")
    run(_cfg(tiny_dir, tmp_path / "none", steps=1, save_every=0))
    assert iterations(tmp_path / "none") == [1] and latest_iteration(tmp_path / "none") == 1


def test_resume_false_over_an_earlier_run_is_refused_and_harms_nothing(run3, tiny_dir, tmp_path, capsys):
    """Class 1 (the issue's case: a shorter fresh run would be pruned by keep_last as soon as written, with
    ``latest`` naming it) and class 2 (its failing first step emptied the earlier run's metrics.jsonl)."""
    from recipes.sft import run

    root = _copy(run3, tmp_path)
    before = _tree(root)
    with pytest.raises(ValueError) as e:
        run(_cfg(tiny_dir, root, steps=1, save_every=1, keep_last=1, resume=False))
    msg = str(e.value)
    assert str(root) in msg and "train.resume=true" in msg and "train.out" in msg and "\n" not in msg, msg
    assert _tree(root) == before
    # the same through the console: exit 2, one line
    args = ["sft", f"model.hf_dir={tiny_dir}", f"data.train={tmp_path / 'train.jsonl'}", "data.max_tokens=64",
            "data.micro_batch_tokens=128", "data.global_batch_tokens=128", "lora.rank=4", "train.steps=1",
            f"train.out={root}", "train.resume=false", "train.progress=false", "wandb.mode=disabled"]
    assert glm5(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.resume=false" in err[0] and str(root) in err[0], err
    assert _tree(root) == before


def test_saves_hand_their_write_results_back_without_a_process(run3):
    """The run's sharded saves (``checkpoint.dist.save_sharded``) gave Megatron's writer a thread queue for its
    results: no ``multiprocessing`` Manager (a spawned server process per rank) was started for them."""
    import multiprocessing
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    assert (run3[0] / "iter_0000002" / "optimizer" / "dist").is_dir()
    assert type(filesystem_async._results_queue) is queue.Queue
    assert not [p.name for p in multiprocessing.active_children() if "Manager" in p.name]


def test_keep_last_never_prunes_the_iteration_just_saved(tmp_path):
    """Class 1, the shared mechanism: pruning counts iterations up to the one just saved only."""
    from glm5_mcore.checkpoint.layout import iterations, prune_iterations

    for it in (1, 2, 4, 6, 8):
        (tmp_path / f"iter_{it:07d}").mkdir()
    assert prune_iterations(tmp_path, 1, 2) == [1]  # 2 just saved; 4, 6, 8 are not its series
    assert iterations(tmp_path) == [2, 4, 6, 8]
    assert prune_iterations(tmp_path, 2, 8) == [2, 4] and iterations(tmp_path) == [6, 8]
    assert prune_iterations(tmp_path, 0, 8) == [] and iterations(tmp_path) == [6, 8]


def test_a_run_failing_before_its_first_step_leaves_metrics_byte_identical(run3, tiny_dir, tmp_path, monkeypatch):
    """Class 2: the metrics file is first touched by the first row the new run writes (a fresh run in a
    folder with no checkpoint, and a resume whose redone steps were logged by the interrupted run)."""
    import recipes.sft as sft
    from glm5_mcore.checkpoint.layout import write_latest

    def boom(*a, **k):
        raise RuntimeError("step 1 failed")

    monkeypatch.setattr(sft, "step_losses", boom)
    root = _copy(run3, tmp_path)
    shutil.rmtree(root / "iter_0000003")  # killed after logging step 3, before its checkpoint
    write_latest(root, 2)
    before = (root / "metrics.jsonl").read_bytes()
    assert [json.loads(x)["step"] for x in before.splitlines()] == [1, 2, 3]
    with pytest.raises(RuntimeError, match="step 1 failed"):
        sft.run(_cfg(tiny_dir, root, steps=4))
    assert (root / "metrics.jsonl").read_bytes() == before
    # an earlier run that died before any checkpoint: a fresh start keeps its file until it logs
    fresh = tmp_path / "fresh"
    shutil.copytree(root, fresh, ignore=shutil.ignore_patterns("iter_*", "latest"))
    with pytest.raises(RuntimeError, match="step 1 failed"):
        sft.run(_cfg(tiny_dir, fresh, resume=False))
    assert (fresh / "metrics.jsonl").read_bytes() == before


@pytest.mark.parametrize("latest", ["7\n", "junk\n", ""])
def test_checkpoint_verify_refuses_a_latest_no_loader_accepts(run3, tmp_path, capsys, latest):
    """Class 11: ``latest`` naming a missing iteration, holding junk, or absent beside iter_* folders."""
    root = _copy(run3, tmp_path)
    if latest:
        (root / "latest").write_text(latest)
    else:
        (root / "latest").unlink()
    before = _tree(root)
    assert glm5(["checkpoint", "verify", str(root)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("glm5 checkpoint: error: ") and str(root / "latest") in err[0], err
    assert _tree(root) == before
    (root / "latest").write_text("3\n")
    assert glm5(["checkpoint", "verify", str(root)]) == 0


def test_full_fine_tuning_on_a_padded_vocabulary_resumes_bitwise_and_across_a_padding_change(tiny_odd_dir, tmp_path):
    """Full fine-tuning of a 129-token vocabulary padded to 256 rows (``parallel.make_vocab_size_divisible_by=128``:
    the trained embedding and output layer, their Adam moments, saved with the padded rows): stopped after step 2
    and resumed, step 3's loss is the uninterrupted run's, bit for bit. Resuming it unpadded is a layout change,
    refused by name; with ``train.allow_resume_mismatch`` the 256-row weights and moments load into 129 rows
    (Megatron-Core's ``allow_shape_mismatch``) and step 3 is again the same loss."""
    from recipes.sft import run
    from tests.support.sft_setup import sft_cfg

    def cfg(out, steps, divisible_by, **train):
        return sft_cfg(tiny_odd_dir, tmp_path, parallel={"make_vocab_size_divisible_by": divisible_by},
                       train={"steps": steps, "save_every": 1, "eval_every": 0, "out": str(tmp_path / out), **train})

    def losses(c):
        return [h["loss"] for h in run(c)["history"]]

    full = losses(cfg("a", 3, 128))
    assert losses(cfg("b", 2, 128)) == full[:2] and losses(cfg("b", 3, 128)) == full[2:]
    shutil.copytree(tmp_path / "b", tmp_path / "c")
    shutil.rmtree(tmp_path / "c" / "iter_0000003")
    (tmp_path / "c" / "latest").write_text("2\n")
    with pytest.raises(ValueError, match=r"layout.make_vocab_size_divisible_by: 128 -> '<absent>'"):
        run(cfg("c", 3, 1))
    assert losses(cfg("c", 3, 1, allow_resume_mismatch=True)) == full[2:]

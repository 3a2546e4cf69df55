"""The optimizer state is Megatron-Core's sharded optimizer state, saved and restored through
dist_checkpointing: an SFT run resumed at DP 2 (gloo) ends with the same Adam state, bit for bit, as
the run that was never interrupted."""

import json
import re

import pytest
import torch

from tests.support.launch import last_json, torchrun


SFT = ["data.micro_batch_tokens=64", "data.global_batch_tokens=256", "data.max_tokens=48", "lora.rank=4",
       "optim.lr=3e-3", "optim.decay_style=constant", "train.save_every=2", "train.keep_last=0", "train.eval_every=0",
       "train.progress=false", "wandb.mode=disabled"]
"""The LoRA SFT runs every test here resumes (save at step 2), beside the model and the data."""


def _data(path, n=48):
    with open(path, "w") as f:
        for i in range(n):
            words = " ".join(f"w{(i * 11 + k) % 90}" for k in range(3 + i % 7))
            f.write(json.dumps({"prompt": words, "response": f"w{i % 80} w{i % 80 + 1} w{i % 80 + 2}"}) + "\n")
    return str(path)


def _resume_runs(args, out, steps):
    """{layout: {"a", "b_first", "b_resumed": losses}} of ``tests/workers/resume_check.py`` on two gloo ranks."""
    return last_json(torchrun("resume_check.py", out, steps, *args).stdout)


def _optimizer_tensors(path) -> dict:
    from megatron.core.dist_checkpointing import load_plain_tensors

    return {k: v for k, v in load_plain_tensors(str(path)).items() if isinstance(v, torch.Tensor)}


def _check_layout(runs, root):
    full, first, resumed = runs["a"], runs["b_first"], runs["b_resumed"]
    assert first == full[:2] and resumed == full[2:], (full, first, resumed)
    a = _optimizer_tensors(root / "a" / "iter_0000004" / "optimizer" / "dist")
    b = _optimizer_tensors(root / "b" / "iter_0000004" / "optimizer" / "dist")
    moments = [k for k in a if "exp_avg" in k]
    assert moments and any(".lora." in k for k in moments), sorted(a)[:8]
    assert set(a) == set(b)
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, differ[:5]
    # and the state did move between the two checkpoints (the comparison is not of two empty states)
    two = _optimizer_tensors(root / "a" / "iter_0000002" / "optimizer" / "dist")
    assert any(not torch.equal(two[k], a[k]) for k in moments)
    return a


@pytest.mark.slow
def test_sft_resume_at_dp2_and_tp2_restores_the_optimizer_state_bitwise(tiny_dir, tmp_path, single_rank):
    """Both layouts on two gloo ranks: DP 2, and TP 2, where the TP-sharded LoRA tensors' moments are
    saved as the two halves of one global tensor (GLU fc1's B as gate and up halves)."""
    args = [f"model.hf_dir={tiny_dir}", f"data.train={_data(tmp_path / 't.jsonl')}", *SFT]
    runs = _resume_runs(args, tmp_path, 4)  # b is "killed" after step 2's checkpoint
    dp2 = _check_layout(runs["dp2"], tmp_path / "dp2")
    tp2 = _check_layout(runs["tp2"], tmp_path / "tp2")
    # TP 2 saved global adapter moments (both TP halves), shaped as the TP 1 run's
    assert set(tp2) == set(dp2)
    shapes = {k: (tuple(tp2[k].shape), tuple(dp2[k].shape)) for k in dp2 if tp2[k].shape != dp2[k].shape}
    assert not shapes, list(shapes.items())[:4]


EXPERT_SFT = [*SFT, "lora.targets=[linear_q_up_proj,experts.linear_fc1,experts.linear_fc2]"]
ALLOW = "train.allow_resume_mismatch=true"


@pytest.fixture(scope="module")
def expert_runs(tiny_dir, tmp_path_factory):
    """Every ``glm5 sft`` run both expert-layout tests read, at two gloo ranks with adapters on the routed
    experts, in one torchrun launch (``tests/workers/sft_cli_runs.py``: each run through the console's entry
    point, in order): ETP 1 ("a") and ETP 2 ("b") saved at step 2, each copied there ("a_at2", "b_at2"), then
    each resumed at its own ETP to step 3 ("a3", "b3"); the step-2 copies resumed at another expert layout
    (refused without ``train.allow_resume_mismatch``, then with it: "etp2", "ep2", "etp2->etp1"); a
    distributed-optimizer run saved at step 2 and its refused resume at ETP 2. (root, {name: result})."""
    root = tmp_path_factory.mktemp("expert_layouts")
    base = [f"model.hf_dir={tiny_dir}", f"data.train={_data(root / 't.jsonl')}", *EXPERT_SFT]

    def sft(name, out, steps, *extra, copy=()):
        return {"name": name, "argv": [*base, *extra, f"train.steps={steps}", f"train.out={root / out}"],
                "copy": [[str(root / a), str(root / b)] for a, b in copy]}

    runs = [sft("a", "a", 2, "parallel.etp=1"), sft("b", "b", 2, "parallel.etp=2"),
            sft("a3", "a", 3, "parallel.etp=1", copy=[("a", "a_at2"), ("b", "b_at2")]),  # uninterrupted step 3
            sft("b3", "b", 3, "parallel.etp=2"),
            sft("etp2_refused", "etp2", 3, "parallel.etp=2",
                copy=[("a_at2", "etp2"), ("a_at2", "ep2"), ("b_at2", "b_to_etp1")]),
            sft("etp2", "etp2", 3, "parallel.etp=2", ALLOW), sft("ep2", "ep2", 3, "parallel.ep=2", ALLOW),
            sft("etp2->etp1", "b_to_etp1", 3, "parallel.etp=1", ALLOW),
            sft("dist", "dist", 2, "parallel.etp=1", "optim.distributed=true"),
            sft("dist_refused", "dist", 3, "parallel.etp=2", "optim.distributed=true", ALLOW)]
    (root / "runs.json").write_text(json.dumps(runs))
    return root, last_json(torchrun("sft_cli_runs.py", root / "runs.json", timeout=1200).stdout)


def _losses(results, name):
    r = results[name]
    assert r["rc"] == [0, 0] and not r["traceback"], (name, r)
    return r["out"]["losses"]


def _one_line_errors(results, name):
    r = results[name]
    assert all(rc != 0 for rc in r["rc"]) and len(r["errors"]) == 2 and not r["traceback"], (name, r)  # each rank
    return r["errors"]


@pytest.mark.slow
def test_expert_adapter_optimizer_state_saved_at_etp2_is_the_etp1_state_and_resumes_across_etp(expert_runs,
                                                                                             single_rank):
    """Adapters on the routed experts at expert TP 2 (issue 40 item 2): their Adam moments are saved as the global
    tensors the ETP 1 run saves (each expert's fc1 B as gate and up halves over the ETP shards, fc2 A split on
    dim 1, the replicated factors once), with its values (the keys and offsets of the experts' own weights), and
    the ETP 2 run resumes from it to the ETP 1 run's next loss."""
    root, results = expert_runs
    # ETP 2 chains a dense and an expert optimizer (the experts' expert-DP group is not the DP group); the
    # distributed optimizer's keys would carry a ``chained_N.`` prefix there
    one, two = ({re.sub(r"^chained_\d+\.", "", k): v for k, v in
                 _optimizer_tensors(root / f"{name}_at2" / "iter_0000002" / "optimizer" / "dist").items()}
                for name in ("a", "b"))
    experts = [k for k in one if ".experts." in k and ".lora." in k and "exp_avg" in k]
    assert len(experts) >= 4 and set(one) == set(two), (experts, sorted(set(one) ^ set(two))[:4])
    for k in one:
        assert one[k].shape == two[k].shape, (k, one[k].shape, two[k].shape)
        diff = float((two[k] - one[k]).abs().max() / one[k].abs().max())  # fp32 reduction order: 1.4e-6 seen
        assert diff <= 1e-5, (k, diff)
    # each resumed at its own ETP (across ETP 1 / 2, where the optimizer is chained on one side only:
    # test_sft_resumed_at_another_expert_layout_gives_the_uninterrupted_runs_next_loss)
    nexts = [_losses(results, "a3"), _losses(results, "b3")]
    assert [len(n) for n in nexts] == [1, 1], nexts  # resumed: step 3 only
    assert abs(nexts[1][0] - nexts[0][0]) / nexts[0][0] <= 1e-5, nexts


@pytest.mark.slow
def test_sft_resumed_at_another_expert_layout_gives_the_uninterrupted_runs_next_loss(expert_runs):
    """ETP 1 saved at step 2, resumed at ETP 2 and at EP 2 (where Megatron chains a dense and an expert optimizer,
    ETP 1 / EP 1 builds one), and ETP 2 saved, resumed at ETP 1: step 3's loss is the uninterrupted ETP 1 run's
    within fp32 reordering (1e-5 relative), each parameter's Adam state loaded into the other optimizer structure.
    Without ``train.allow_resume_mismatch`` the layout change is refused in one line naming the field; the
    distributed optimizer's state (``dp_reshardable``, DP-reshardable only) is refused in one line even with it."""
    root, results = expert_runs
    (ref,) = _losses(results, "a3")  # the uninterrupted run's step 3
    errors = _one_line_errors(results, "etp2_refused")
    assert all("layout.etp: '<absent>' -> 2" in e and ALLOW in e for e in errors), errors
    assert _losses(results, "b") == pytest.approx(_losses(results, "a"), rel=1e-5)
    for name in ("etp2", "ep2", "etp2->etp1"):
        got = _losses(results, name)
        assert len(got) == 1 and abs(got[0] - ref) / ref <= 1e-5, (name, got, ref)
    # the distributed optimizer's dp_reshardable buffers: refused in one line, even with the switch
    _losses(results, "dist")
    errors = _one_line_errors(results, "dist_refused")
    assert all("saved by 1 chained optimizer(s), this layout builds 2" in e for e in errors), errors

"""``glm5 lora export --merged`` of a LoRA run whose base is its HF origin (issue 34, class 15): it merges
onto the weights the run trained on, as ``checkpoint export --merge-adapter`` does (one mechanism,
``glm5_mcore.convert.merge_base``), ``--base`` gives the same result from the HF folder or a checkpoint of
it, and ``--base`` without ``--merged`` is one line."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from glm5_mcore.checkpoint.hf_io import HFCheckpoint
from recipes.main import main as glm5


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tiny_dir):
    """A 2-step LoRA SFT run from model.hf_dir: adapters only, its base the HF origin."""
    from recipes.sft import SFTConfig, run

    root = tmp_path_factory.mktemp("lora_run")
    with open(root / "train.jsonl", "w") as f:
        for i in range(16):
            f.write(json.dumps({"prompt": f"w{i} w{i + 3} w{i + 1}", "response": f"w{i + 2} w{i + 4}"}) + "\n")
    run(SFTConfig.from_dict({
        "model": {"hf_dir": tiny_dir},
        "data": {"train": str(root / "train.jsonl"), "micro_batch_tokens": 128, "global_batch_tokens": 128,
                 "max_tokens": 64},
        "optim": {"lr": 1e-2, "decay_style": "constant"}, "lora": {"enabled": True, "rank": 4},
        "train": {"steps": 2, "out": str(root / "run"), "progress": False}, "wandb": {"mode": "disabled"}}))
    return root / "run"


def _tensors(folder) -> dict:
    ck = HFCheckpoint(folder)
    return {k: ck.get(k) for k in sorted(ck.keys())}


def test_lora_export_merged_of_a_run_from_its_hf_origin(lora_run, tiny_dir, tmp_path, capsys):
    from glm5_mcore.checkpoint.atomic import OWNER
    from glm5_mcore.convert.hf_to_mcore import hf_to_mcore
    from glm5_mcore.lora.state import read_adapter_state
    from glm5_mcore.checkpoint.layout import adapter_dir

    stale = tmp_path / ".glm5-export-stale"  # a killed export's scratch (its owner pid long gone)
    stale.mkdir()
    import socket

    (stale / OWNER).write_text(json.dumps({"pid": 1 << 22, "host": socket.gethostname()}))
    assert glm5(["lora", "export", "--ckpt", str(lora_run), "--merged", "--out", str(tmp_path / "m"),
                 "--no-progress"]) == 0, capsys.readouterr().err
    assert not stale.exists() and not list(tmp_path.glob(".glm5-export-*"))  # its own scratch removed too
    merged, base = _tensors(tmp_path / "m"), _tensors(tiny_dir)
    assert sorted(merged) == sorted(base)
    state = read_adapter_state(adapter_dir(lora_run, "default"))
    q = "model.layers.0.self_attn.q_a_proj.weight"
    want = base[q].float() + state.delta("decoder.layers.0.self_attention.linear_q_down_proj")
    assert any(not torch.equal(merged[k], base[k]) for k in base)
    assert torch.allclose(merged[q].float(), want, atol=1e-6), (merged[q].float() - want).abs().max()
    # --base: the HF folder, or a checkpoint of it, merge to the same bytes
    ck = hf_to_mcore(tiny_dir, tmp_path / "base_ck", progress=False)
    for b, name in ((tiny_dir, "mb_hf"), (ck, "mb_ck")):
        assert glm5(["lora", "export", "--ckpt", str(lora_run), "--merged", "--base", str(b), "--out",
                     str(tmp_path / name), "--no-progress"]) == 0, capsys.readouterr().err
        got = _tensors(tmp_path / name)
        assert all(torch.equal(got[k], merged[k]) for k in merged), name
    # --base of other weights of the same shapes (another seed): refused by the run's recorded origin fingerprint,
    # in one line naming the flag that merges anyway (it merged onto any model of the right shapes)
    from glm5_mcore.tiny import write_tiny

    other = write_tiny(tmp_path / "other", seed=1)
    capsys.readouterr()
    argv = ["lora", "export", "--ckpt", str(lora_run), "--merged", "--base", str(other), "--out",
            str(tmp_path / "mo"), "--no-progress"]
    assert glm5(argv) == 2
    err = capsys.readouterr().err
    print(err)
    assert err.count("\n") == 1 and err.startswith(f"glm5 lora: error: --base {other}: not the weights the run ") and \
        "weights sha256" in err and "pass --allow-other-base to merge onto it anyway" in err, err
    assert not (tmp_path / "mo").exists()
    assert glm5([*argv, "--allow-other-base"]) == 0 and (tmp_path / "mo" / "config.json").is_file()
    assert "glm5: notice: --base" in capsys.readouterr().err
    assert glm5(["lora", "export", "--ckpt", str(lora_run), "--base", str(tiny_dir), "--out",
                 str(tmp_path / "p")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--base" in err[0] and "--merged" in err[0] and not (tmp_path / "p").exists(), err

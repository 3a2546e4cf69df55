"""Never lose a user's data: guarded output folders, existing iterations, checksums, finite weights,
honest data counts, resume guards, and a one-line error (exit 2) for every bad input.

Every refused run leaves the previous output and the inputs byte-identical (``_tree``)."""

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from recipes.main import main as glm5
from tests.support.sft_setup import count_rows, lora_step_cfg


def _tree(path) -> dict:
    """{relative path: sha256} of every file under ``path`` (or of the file itself), hidden ones too."""
    path = Path(path)
    if path.is_file():
        return {"": hashlib.sha256(path.read_bytes()).hexdigest()}
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _refused(capsys, argv, *needles, untouched=()):
    """Run ``glm5 argv``: exit 2, one stderr line naming every needle, ``untouched`` paths unchanged,
    and no temporary / old sibling left behind."""
    before = {str(p): _tree(p) for p in untouched}
    parents = {Path(p).absolute().parent for p in untouched}
    siblings = {d: sorted(x.name for x in d.iterdir()) for d in parents if d.is_dir()}
    code = glm5(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, (code, err)
    line = err[-1]
    assert line.startswith(f"glm5 {argv[0]}: error: "), line
    for n in needles:
        assert str(n) in line, (n, line)
    assert "Traceback" not in "\n".join(err)
    for p, t in before.items():
        assert _tree(p) == t, p
    for d, names in siblings.items():
        assert sorted(x.name for x in d.iterdir()) == names, d
    return line


def _flip(path: Path, offset: int = None) -> None:
    raw = bytearray(path.read_bytes())
    i = len(raw) // 2 if offset is None else offset
    raw[i] ^= 0x01
    path.write_bytes(bytes(raw))


# --------------------------------------------------------------------------------------------------
# 1. output folders
# --------------------------------------------------------------------------------------------------
def test_out_that_is_not_ours_is_refused_and_kept(tmp_path, capsys):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    _refused(capsys, ["tiny", "--out", str(mine)], mine, "thesis.tex", "--overwrite", untouched=[mine])
    afile = tmp_path / "notes.txt"
    afile.write_text("keep me")
    _refused(capsys, ["tiny", "--out", str(afile)], afile, "existing file", untouched=[afile])
    # an empty folder and a previous `glm5 tiny` output are fine; --overwrite replaces the user's folder
    (tmp_path / "empty").mkdir()
    assert glm5(["tiny", "--out", str(tmp_path / "empty")]) == 0
    assert glm5(["tiny", "--out", str(tmp_path / "empty"), "--seed", "1"]) == 0
    assert glm5(["tiny", "--out", str(mine), "--overwrite"]) == 0
    assert not (mine / "thesis.tex").exists() and (mine / "config.json").is_file()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_out_equal_inside_or_containing_an_input_is_always_refused(tiny_dir, tiny_converted, tmp_path, capsys):
    src = tmp_path / "models" / "tiny"
    shutil.copytree(tiny_dir, src)
    for out, rel in ((src, "is the input"), (src / "sub", "is inside the input"),
                     (tmp_path / "models", "contains the input")):
        _refused(capsys, ["convert", "hf-to-mcore", "--hf-dir", str(src), "--out", str(out), "--overwrite",
                          "--no-progress"], rel, untouched=[tmp_path / "models"])
    ck = tmp_path / "ck"
    shutil.copytree(tiny_converted, ck)
    _refused(capsys, ["convert", "mcore-to-hf", "--ckpt", str(ck), "--out", str(ck), "--overwrite", "--no-progress"],
             "is the input", untouched=[ck])
    _refused(capsys, ["convert", "mcore-to-hf", "--ckpt", str(ck), "--out", str(ck / "hf"), "--no-progress"],
             "is inside the input", untouched=[ck])
    _refused(capsys, ["lora", "export", "--ckpt", str(ck), "--out", str(ck), "--overwrite"], "is the input",
             untouched=[ck])


def test_out_under_a_file_or_read_only_folder_is_one_line(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    _refused(capsys, ["tiny", "--out", str(tmp_path / "f" / "out")], tmp_path / "f", untouched=[tmp_path / "f"])
    if os.geteuid() == 0:
        return  # root writes anywhere: a read-only folder cannot refuse it
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        _refused(capsys, ["tiny", "--out", str(ro / "out")], ro, "not writable", untouched=[ro])
    finally:
        ro.chmod(0o755)


def test_convert_into_a_previous_output_of_another_command_is_refused(tiny_dir, tiny_converted, tmp_path, capsys):
    hf = tmp_path / "hf"
    assert glm5(["tiny", "--out", str(hf)]) == 0
    _refused(capsys, ["convert", "mcore-to-hf", "--ckpt", str(tiny_converted), "--out", str(hf), "--no-progress"],
             "previous 'tiny' output", untouched=[hf, tiny_converted])
    _refused(capsys, ["convert", "hf-to-mcore", "--hf-dir", tiny_dir, "--out", str(hf), "--no-progress"],
             "previous 'tiny' output", untouched=[hf])


def test_parity_save_logits_and_input_ids_are_checked_before_work(tiny_dir, tmp_path, capsys):
    from safetensors.torch import save_file

    _refused(capsys, ["parity", "--hf-dir", tiny_dir, "--save-logits", str(tmp_path / "nope" / "l.st")],
             "nope", "does not exist")
    mine = tmp_path / "mine.safetensors"
    save_file({"x": torch.zeros(2)}, str(mine))
    _refused(capsys, ["parity", "--hf-dir", tiny_dir, "--save-logits", str(mine)], mine, "--overwrite",
             untouched=[mine])
    _refused(capsys, ["parity", "--hf-dir", tiny_dir, "--save-logits", str(tmp_path)], "names a folder")
    ids = tmp_path / "ids.safetensors"
    cases = {"empty": b"", "zero-length": None, "fractional": None}
    for name in cases:
        if name == "empty":
            ids.write_bytes(b"")
            needle = "not a readable safetensors file"
        elif name == "zero-length":
            save_file({"input_ids": torch.zeros(1, 0, dtype=torch.long)}, str(ids))
            needle = "is empty"
        else:
            save_file({"input_ids": torch.tensor([[1.5, 2.0]])}, str(ids))
            needle = "expected an integer type"
        _refused(capsys, ["parity", "--hf-dir", tiny_dir, "--input-ids", str(ids)], ids, needle, untouched=[ids])
    _refused(capsys, ["parity", "--hf-dir", tiny_dir, "--input-ids", str(ids), "--save-logits", str(ids)],
             "is the input", untouched=[ids])


# --------------------------------------------------------------------------------------------------
# 2. iterations, 3. checksums, 4. values
# --------------------------------------------------------------------------------------------------
def test_missing_iteration_is_an_error_listing_those_that_exist(tiny_converted, tiny_lora_run, tmp_path, capsys):
    _refused(capsys, ["convert", "mcore-to-hf", "--ckpt", str(tiny_converted), "--out", str(tmp_path / "o"), "--iteration", "5",
                      "--no-progress"], "iteration 5 does not exist", "[0]", untouched=[tiny_converted])
    run = tiny_lora_run / "run"
    _refused(capsys, ["lora", "export", "--ckpt", str(run), "--out", str(tmp_path / "o"), "--iteration", "7"],
             "iteration 7 does not exist", "[1]", untouched=[run])
    assert not (tmp_path / "o").exists()


def test_a_flipped_byte_in_any_checkpoint_file_is_caught_and_named(tiny_converted, tiny_lora_run, tmp_path, capsys):
    """Every file kind an iteration holds (DCP data, metadata, common state, adapter weights and
    config, optimizer state, trainer state) and a converted HF folder's shards."""
    ck, run = tmp_path / "ck", tmp_path / "run"
    shutil.copytree(tiny_converted, ck)
    shutil.copytree(tiny_lora_run / "run", run)
    hf = tmp_path / "hf"
    assert glm5(["convert", "mcore-to-hf", "--ckpt", str(ck), "--out", str(hf), "--no-progress"]) == 0
    capsys.readouterr()
    files = [p for d in (ck / "iter_0000000", run / "iter_0000001", hf) for p in sorted(d.rglob("*"))
             if p.is_file() and p.name not in ("manifest.json", ".glm5-output")]
    kinds = {p.suffix or p.name for p in files}
    assert {".distcp", ".metadata", ".pt", ".safetensors", ".json"} <= kinds, kinds
    for f in files:
        good = f.read_bytes()
        _flip(f)
        root = next(d for d in (ck, run, hf) if d in f.parents)
        _refused(capsys, ["checkpoint", "verify", str(root)], f, "checksum mismatch")
        f.write_bytes(good)
    assert glm5(["checkpoint", "verify", str(ck)]) == 0 and glm5(["checkpoint", "verify", str(run)]) == 0


def test_loads_verify_what_they_read(tiny_converted, tiny_lora_run, tiny_dir, tmp_path, capsys, monkeypatch):
    from glm5_mcore.checkpoint.dist import load_rank_state
    from recipes.sft import run as sft

    monkeypatch.setenv("GLM5_VERIFY_CHECKSUMS", "1")  # --no-verify below sets it to 0 in this process

    ck = tmp_path / "ck"
    shutil.copytree(tiny_converted, ck)
    data = next((ck / "iter_0000000" / "model").glob("*.distcp"))
    _flip(data)
    out = tmp_path / "hf"
    _refused(capsys, ["convert", "mcore-to-hf", "--ckpt", str(ck), "--out", str(out), "--no-progress"],
             data, "checksum mismatch", untouched=[ck])
    assert not out.exists()
    # --no-verify skips the check (same bytes, same size): the damage goes through unnoticed
    assert glm5(["convert", "mcore-to-hf", "--ckpt", str(ck), "--out", str(out), "--no-progress", "--no-verify",
                 "--allow-nonfinite"]) == 0
    monkeypatch.setenv("GLM5_VERIFY_CHECKSUMS", "1")
    data.unlink()  # a missing .distcp: named, not a cut-off torch traceback
    _refused(capsys, ["convert", "mcore-to-hf", "--ckpt", str(ck), "--out", str(out), "--no-progress"],
             data, "missing (listed in", untouched=[ck, out])
    # SFT resume: a damaged adapter / optimizer file names the file, verified or not
    root = tmp_path / "sft"
    shutil.copytree(tiny_lora_run, root)
    it = root / "run" / "iter_0000001"
    cfg = lora_step_cfg(tiny_dir, root, data={"train": str(root / "train.jsonl")}, train={"steps": 2})
    for f in (it / "adapters" / "default" / "adapter_model.safetensors", it / "optimizer" / "rank_00000.pt"):
        good = f.read_bytes()
        f.write_bytes(good[: len(good) // 2])
        with pytest.raises(ValueError, match=f"{f.name}: .*bytes, the manifest says"):
            sft(cfg)
        monkeypatch.setenv("GLM5_VERIFY_CHECKSUMS", "0")
        with pytest.raises(ValueError, match=f"{f}: unreadable"):
            sft(cfg)
        with pytest.raises(ValueError, match=f"{f.name}: unreadable"):
            load_rank_state(root / "run", 1, 0) if f.suffix == ".pt" else glm5_read_adapter(f.parent)
        monkeypatch.setenv("GLM5_VERIFY_CHECKSUMS", "1")
        f.write_bytes(good)


def test_truncated_peft_adapter_is_named(tiny_lora_run, tmp_path, monkeypatch):
    from glm5_mcore.convert.lora_export import export_checkpoint_adapter
    from glm5_mcore.lora.peft import import_peft

    out = export_checkpoint_adapter(tiny_lora_run / "run", tmp_path / "peft", progress=False)
    f = out / "adapter_model.safetensors"
    f.write_bytes(f.read_bytes()[:-64])
    with pytest.raises(ValueError, match=f"{f}: .* bytes, the manifest says"):
        import_peft(out, 3)
    monkeypatch.setenv("GLM5_VERIFY_CHECKSUMS", "0")
    with pytest.raises(ValueError, match=f"{f}: unreadable safetensors file"):
        import_peft(out, 3)


def glm5_read_adapter(path):
    from glm5_mcore.lora.state import read_adapter_state

    return read_adapter_state(path)


def test_nonfinite_weights_are_refused_naming_the_tensor(tiny_dir, tmp_path, capsys, single_rank):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "nan"
    shutil.copytree(tiny_dir, bad)
    (bad / "manifest.json").unlink()  # edited by hand below
    sd = load_file(bad / "model.safetensors")
    sd["model.layers.1.self_attn.kv_b_proj.weight"][3, 5] = float("nan")
    save_file(sd, str(bad / "model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "mc"
    assert glm5(["convert", "hf-to-mcore", "--hf-dir", tiny_dir, "--out", str(out), "--no-progress"]) == 0
    _refused(capsys, ["convert", "hf-to-mcore", "--hf-dir", str(bad), "--out", str(out), "--no-progress"],
             "model.layers.1.self_attn.kv_b_proj.weight", "non-finite", untouched=[out, bad])
    nan_ck = tmp_path / "nan_ck"
    assert glm5(["convert", "hf-to-mcore", "--hf-dir", str(bad), "--out", str(nan_ck), "--no-progress",
                 "--allow-nonfinite"]) == 0
    capsys.readouterr()
    _refused(capsys, ["convert", "mcore-to-hf", "--ckpt", str(nan_ck), "--out", str(tmp_path / "back"),
                      "--no-progress"], "model.layers.1.self_attn.kv_b_proj.weight", "non-finite",
             untouched=[nan_ck])
    assert not (tmp_path / "back").exists()
    # loading refuses them too: the Megatron checkpoint and the HF folder
    from glm5_mcore.checkpoint.dist import load_model
    from glm5_mcore.checkpoint.layout import model_dir
    from glm5_mcore.config import GLM5Config
    from glm5_mcore.model.build import build_model
    from glm5_mcore.checkpoint.hf_load import load_hf_weights

    glm5_cfg = GLM5Config.from_hf_dir(bad)
    m = build_model(glm5_cfg)
    with pytest.raises(ValueError, match="linear_kv_up_proj.weight has 1 non-finite"):
        load_model(m, model_dir(nan_ck))
    with pytest.raises(ValueError, match="kv_b_proj.weight has 1 non-finite"):
        load_hf_weights(m, bad, glm5_cfg)


# --------------------------------------------------------------------------------------------------
# 5. data, 6. resume guards, 7. named errors
# --------------------------------------------------------------------------------------------------
def test_rows_cut_by_max_tokens_are_counted_or_bad_and_bad_utf8_is_named(tiny_dir, tmp_path):
    from transformers import AutoTokenizer

    from glm5_mcore.data.sft import DataError, DataStats, read_jsonl

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    long_prompt = json.dumps({"prompt": " ".join(["w1"] * 80), "response": "w2 w3"})
    long_resp = json.dumps({"prompt": "w1", "response": " ".join(["w2"] * 80)})
    path = count_rows(tmp_path / "d.jsonl", n=3, extra=[long_resp, long_prompt])
    with pytest.raises(DataError, match=f"{path}:5: .*keeps no loss token"):
        read_jsonl(path, tok, 32)
    stats = DataStats()
    docs = read_jsonl(path, tok, 32, skip_bad_rows=True, stats=stats)
    assert len(docs) == 4 and stats.skipped == 1 and stats.truncated == 1 and stats.truncated_rows == [f"{path}:4"]
    with open(path, "ab") as f:
        f.write(b'{"text": "w1 \xff w2"}\n')
    utf = count_rows(tmp_path / "u.jsonl", n=2)
    with open(utf, "ab") as f:
        f.write(b'{"text": "w1 \xff w2"}\n')
    with pytest.raises(DataError, match=f"{utf}:3: not valid UTF-8 \\(byte 0xff at column 14\\)"):
        read_jsonl(utf, tok, 32)
    stats = DataStats()
    read_jsonl(path, tok, 32, skip_bad_rows=True, stats=stats)
    assert stats.skipped == 2 and any(":6: not valid UTF-8" in e for e in stats.errors)
    from rl.tasks.prompts import PromptDataError, read_prompts

    prompts = tmp_path / "p.jsonl"
    prompts.write_bytes(b'{"prompt": "w1", "ground_truth": "w2"}\n{"prompt": "w1 \xfe", "ground_truth": "w2"}\n')
    with pytest.raises(PromptDataError, match=f"{prompts}:2: not valid UTF-8"):
        read_prompts(prompts, tok, chat_template=False, max_tokens=32)


def test_sft_reports_truncated_rows_in_the_json(tiny_dir, tmp_path, capsys):
    from recipes.cli import sft_main

    data = count_rows(tmp_path / "t.jsonl", n=16, extra=[json.dumps({"text": " ".join(["w3"] * 100)})])
    assert sft_main([f"model.hf_dir={tiny_dir}", f"data.train={data}", "data.micro_batch_tokens=64",
                     "data.global_batch_tokens=64", "data.max_tokens=64", "lora.rank=2", "train.steps=1",
                     f"train.out={tmp_path / 'run'}", "train.progress=false", "wandb.mode=disabled"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out.strip().splitlines()[-1])["truncated_rows"] == 1
    assert f"{data}:17" in cap.err and "1 training" in cap.err


def test_sft_resume_with_changed_settings_is_refused_naming_each_field(tiny_lora_run, tiny_dir, tmp_path):
    from recipes.sft import run as sft

    root = tmp_path / "r"
    shutil.copytree(tiny_lora_run, root)
    before = _tree(root)
    with open(root / "train.jsonl", "a") as f:
        f.write(json.dumps({"prompt": "w1", "response": "w2"}) + "\n")
    cfg = lora_step_cfg(tiny_dir, root, lora={"rank": 8}, data={"micro_batch_tokens": 64, "global_batch_tokens": 128},
                   train={"steps": 2})
    with pytest.raises(ValueError) as e:
        sft(cfg)
    msg = str(e.value)
    for field in ("data.train.size", "data.train.xxh3", "data.micro_batch_tokens", "lora.rank: 4 -> 8",
                  "train.allow_resume_mismatch"):
        assert field in msg, (field, msg)
    assert "data.global_batch_tokens" not in msg and "\n" not in msg
    after = _tree(root)
    assert {k: v for k, v in after.items() if k != "train.jsonl"} == {k: v for k, v in before.items()
                                                                      if k != "train.jsonl"}
    # told to proceed, the rank that cannot fit is still a named error, not a tensor-size traceback
    cfg.train.allow_resume_mismatch = True
    with pytest.raises(ValueError, match="adapters/default: adapter .* does not fit"):
        sft(cfg)
    # a run folder that is not an SFT run's, or that contains the data, is refused
    with pytest.raises(ValueError, match="is a previous 'convert hf-to-mcore' output"):
        sft(lora_step_cfg(tiny_dir, root, train={"out": str(_mc_copy(tmp_path))}))
    with pytest.raises(ValueError, match="contains the input"):
        sft(lora_step_cfg(tiny_dir, root, train={"out": str(root)}))


def test_sft_resume_with_a_longer_cosine_schedule_is_refused_then_recomputed(tiny_dir, tmp_path):
    """``train.steps`` 2 -> 4 on resuming a cosine-decay run: refused in one line naming ``train.steps`` and the
    switch, nothing on disk changed (it continued silently under the saved 2-step schedule: learning rate
    ``min_lr`` from step 3 on); with ``train.allow_resume_mismatch`` steps 3 and 4 run at the 4-step schedule's
    learning rates. A constant schedule does not depend on the length: extending it is not refused
    (``test_resume_continues_with_identical_losses``)."""
    from recipes.sft import run as sft

    count_rows(tmp_path / "train.jsonl")

    def cfg(out, steps, **train):
        return lora_step_cfg(tiny_dir, tmp_path, optim={"decay_style": "cosine", "lr": 1e-2},
                             train={"steps": steps, "save_every": 2, "out": str(tmp_path / out), **train})

    full = [h["lr"] for h in sft(cfg("full", 4))["history"]]
    sft(cfg("run", 2))
    before = _tree(tmp_path / "run")
    with pytest.raises(ValueError) as e:
        sft(cfg("run", 4))
    print(e.value)
    assert "train.steps: 2 -> 4 (the length of the optim.decay_style LR schedule" in str(e.value) and \
        "set train.allow_resume_mismatch=true" in str(e.value) and "\n" not in str(e.value)
    assert _tree(tmp_path / "run") == before
    resumed = [h["lr"] for h in sft(cfg("run", 4, allow_resume_mismatch=True))["history"]]
    assert resumed == full[2:] and resumed[0] > 0, (resumed, full)  # the saved schedule: min_lr (0) by then


def _mc_copy(tmp_path):
    from glm5_mcore.checkpoint.atomic import write_marker

    d = tmp_path / "other"
    d.mkdir()
    (d / "latest").write_text("0\n")
    write_marker(d, "convert hf-to-mcore")
    return d


def test_rl_resume_with_changed_settings_is_refused_before_ray(tiny_dir, tmp_path):
    from glm5_mcore.checkpoint.atomic import write_marker
    from glm5_mcore.checkpoint.layout import write_latest
    from rl.config import RLConfig, run_settings
    from rl.driver import run

    def cfg(**over):
        d = {"model": {"hf_dir": tiny_dir}, "trainer": {"out": str(tmp_path / "rl"), "steps": 2},
             "wandb": {"mode": "disabled"}}
        for k, v in over.items():
            d.setdefault(k, {}).update(v)
        return RLConfig.from_dict(d)

    it = tmp_path / "rl" / "iter_0000001"
    it.mkdir(parents=True)
    (it / "trainer_state.json").write_text(json.dumps({"step": 1, "settings": run_settings(cfg())}))
    write_latest(tmp_path / "rl", 1)
    write_marker(tmp_path / "rl", "rl")
    before = _tree(tmp_path / "rl")
    with pytest.raises(ValueError) as e:
        run(cfg(lora={"rank": 8}, rollout={"n": 4}, data={"prompts_per_step": 32}))
    for field in ("lora.rank: 16 -> 8", "rollout.n: 8 -> 4", "data.prompts_per_step: 16 -> 32",
                  "trainer.allow_resume_mismatch"):
        assert field in str(e.value), (field, str(e.value))
    assert _tree(tmp_path / "rl") == before


def test_config_and_reward_errors_name_the_field_or_function(tiny_dir, tmp_path, capsys):
    from recipes.sft import SFTConfig
    from rl.config import RLConfig
    from rl.tasks.rewards import RewardError, score_batch

    _refused(capsys, ["sft", f"model.hf_dir={tiny_dir}", "data.train=x.jsonl", "train.steps=abc",
                      f"train.out={tmp_path / 'o'}"], "train.steps must be a number, got 'abc'")
    assert not (tmp_path / "o").exists()
    with pytest.raises(ValueError, match="train.steps must be a number, got 'abc'"):
        SFTConfig.from_dict({"train": {"steps": "abc"}})
    with pytest.raises(ValueError, match="rollout.engine='rl.rollout.nope.Engine': no module"):
        RLConfig.from_dict({"rollout": {"engine": "rl.rollout.nope.Engine"}})
    with pytest.raises(ValueError, match="has no 'Nope'"):
        RLConfig.from_dict({"rollout": {"engine": "rl.rollout.hf_engine.Nope"}})

    def boom(data_source, solution, ground_truth, extra=None):
        if solution == "bad":
            raise ZeroDivisionError("division by zero")
        return 1.0

    with pytest.raises(RewardError, match=r"reward function my\.boom raised ZeroDivisionError: division by zero "
                                          r"for sample 1 \(data_source 'toy', response 'bad'\)"):
        score_batch(boom, "my.boom", False, ["toy"] * 2, ["ok", "bad"], [0, 0], [{}, {}])


def test_conversion_verifies_from_the_bytes_it_reads(tiny_converted, tmp_path, capsys, monkeypatch):
    """Issue 34, class 17: mcore-to-hf hashes the checkpoint's files as its loader reads them (no second
    read: the bytes hashed from disk besides are a small part of the model files), and a damaged byte
    the loader never reads (a file's tail) is caught all the same, before anything is published."""
    from glm5_mcore.checkpoint import manifest

    monkeypatch.setenv("GLM5_VERIFY_CHECKSUMS", "1")
    from_disk = []
    orig = manifest._Stream._from_disk

    def counted(self, end):
        from_disk.append((self.path.name, end - self.upto))
        return orig(self, end)

    monkeypatch.setattr(manifest._Stream, "_from_disk", counted)
    assert glm5(["convert", "mcore-to-hf", "--ckpt", str(tiny_converted), "--out", str(tmp_path / "hf"), "--no-progress"]) == 0
    data = sorted((tiny_converted / "iter_0000000" / "model").glob("*.distcp"))
    total = sum(p.stat().st_size for p in data)
    again = sum(n for name, n in from_disk if name.endswith(".distcp"))
    assert again <= 0.1 * total, (again, total)
    from_disk.clear()  # and back: hf-to-mcore verifies the HF folder (it has our manifest) as it reads it
    assert glm5(["convert", "hf-to-mcore", "--hf-dir", str(tmp_path / "hf"), "--out", str(tmp_path / "back"),
                 "--no-progress"]) == 0
    shards = sum(p.stat().st_size for p in (tmp_path / "hf").glob("*.safetensors"))
    again = sum(n for name, n in from_disk if name.endswith(".safetensors"))
    assert 0 < again <= 0.1 * shards, (again, shards)  # > 0: the verifier ran (each file's header)
    ck = tmp_path / "ck"
    shutil.copytree(tiny_converted, ck)
    tail = sorted((ck / "iter_0000000" / "model").glob("*.distcp"))[0]
    _flip(tail, tail.stat().st_size - 1)  # the zip's end record: not a tensor byte
    _refused(capsys, ["convert", "mcore-to-hf", "--ckpt", str(ck), "--out", str(tmp_path / "o"), "--no-progress"],
             tail, "checksum mismatch", untouched=[ck])
    assert not (tmp_path / "o").exists()

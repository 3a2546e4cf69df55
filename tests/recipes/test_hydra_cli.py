"""``glm5 sft`` / ``glm5 rl`` follow Hydra's conventions: --help lists the preset groups and every field with
its doc, --cfg job prints the resolved config, +key / ~key, typed schemas refuse bad keys and values naming
them, -m runs each job in its own folder behind the output guard, and the saved config repeats a job."""

import json
from pathlib import Path

import pytest
import yaml

from recipes.main import main

from tests.support.launch import glm5


def _glm5(capsys, *argv):
    """(exit code, stdout, stderr) of ``glm5 ARGV`` run in this process."""
    rc = main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def _tree(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("kind,fields", [
    ("sft", ["train.steps: int = 100", "Resume even if data files, batch sizes", "parallel.tp: int = 1",
             "optim.lr: float = 0.0001", "lora.targets: list", "Linear families that get adapters"]),
    ("rl", ["rollout.engine: str = 'rl.rollout.hf_engine.HFRolloutEngine'", "Dotted path of a",
            "algorithm.rollout_correction.rollout_is_threshold", "trainer.off_policy_steps: int = 0",
            "model.hf_dir: str | None = 'runs/tiny'"]),
])
def test_help_lists_groups_and_documented_fields(capsys, kind, fields):
    rc, out, err = _glm5(capsys, kind, "--help")
    assert rc == 0 and not err, err
    groups = out.split("Config groups", 1)[1].split("Fields", 1)[0]
    for group, options in (("model", ("tiny", "glm5_744b")), ("lora", ("default", "indexer")),
                           ("wandb", ("offline", "disabled"))):
        assert f"  {group}:" in groups and all(f"      {o} " in groups for o in options), (group, groups)
    if kind == "sft":
        assert "  parallel:" in groups and "tp8_ep64" in groups and "  optim:" in groups
    for f in fields:
        assert f in out, f
    assert "--cfg,-c" in out and "--multirun,-m" in out  # Hydra's own flags


def test_cfg_job_prints_the_resolved_config_and_writes_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, err = _glm5(capsys, "sft", "--cfg", "job", "model=tiny", "optim.lr=3e-4", "lora=indexer")
    assert rc == 0, err
    d = yaml.safe_load(out)
    assert d["model"]["hf_dir"] == "runs/tiny" and d["optim"]["lr"] == 3e-4
    assert "linear_wk" in d["lora"]["targets"] and d["parallel"]["tp"] == 1 and d["train"]["out"] == "runs/sft"
    # a preset config overriding groups (the shipped 744B LoRA job), by the project's --config NAME
    rc, out, _ = _glm5(capsys, "sft", "--config", "sft_glm5_744b_lora", "--cfg", "job")
    d = yaml.safe_load(out)
    assert rc == 0 and d["model"]["ckpt"] == "ckpt/glm5" and (d["parallel"]["tp"], d["parallel"]["ep"]) == (8, 64)
    assert d["optim"]["warmup_steps"] == 20 and d["plan"]["cluster"] == "h100:8"
    # RL: ~key deletes a key a preset set, +key adds one to a free-form mapping
    rc, out, err = _glm5(capsys, "rl", "--config", "glm5_744b", "--cfg", "job", "~rollout.engine_kwargs.max_lora_rank",
                         "+rollout.engine_kwargs.max_num_seqs=64", "actor.lr=2e-5")
    assert rc == 0, err
    d = yaml.safe_load(out)
    kw = d["rollout"]["engine_kwargs"]
    assert "max_lora_rank" not in kw and kw["max_num_seqs"] == 64 and kw["tensor_parallel_size"] == 8
    assert d["model"]["hf_dir"] == "ckpt/glm5/hf" and d["actor"]["lr"] == 2e-5 and d["trainer"]["ep"] == 64
    # a free-form mapping's key as typed, without Hydra's +: added (stream), or set where the preset has it
    rc, out2, err2 = _glm5(capsys, "rl", "--config", "glm5_744b", "--cfg", "job", "rollout.engine_kwargs.stream=false",
                           "rollout.engine_kwargs.tensor_parallel_size=4")
    kw2 = yaml.safe_load(out2)["rollout"]["engine_kwargs"]
    assert rc == 0 and kw2["stream"] is False and kw2["tensor_parallel_size"] == 4, err2
    # glm5 plan's spelling rl/NAME names the same config
    assert _glm5(capsys, "rl", "--config", "rl/glm5_744b", "--cfg", "job", "rollout.engine_kwargs.stream=false",
                 "rollout.engine_kwargs.tensor_parallel_size=4") == (0, out2, err2)
    rc, out, _ = _glm5(capsys, "rl", "--cfg", "job")
    d = yaml.safe_load(out)
    assert rc == 0 and d["model"]["hf_dir"] == "runs/tiny" and d["algorithm"]["adv_estimator"] == "grpo"
    assert list(tmp_path.iterdir()) == []  # no outputs/, .hydra/ or log file


@pytest.mark.slow
def test_console_script_help_and_cfg(tmp_path):
    """The installed ``glm5`` script (Hydra used to raise LexerNoViableAltException on these)."""
    for argv in (["sft", "--help"], ["rl", "--cfg", "job", "--config", "ppo_gae_tiny"]):
        p = glm5(*argv, ok=False, cwd=tmp_path, timeout=120)
        assert p.returncode == 0 and "Exception" not in p.stderr, p.stderr
    assert yaml.safe_load(p.stdout)["algorithm"]["adv_estimator"] == "gae"


@pytest.mark.parametrize("argv,msg", [
    (["sft", "train.stepz=3"], "config: unknown field train.stepz"),
    (["sft", "optim.lr=abc"], "config: optim.lr must be a number, got 'abc'"),
    (["sft", "train.resume=[1]"], "config: train.resume must be true or false, got [1]"),
    (["rl", "trainer.steps=2.5"], "config: trainer.steps must be an integer, got 2.5"),
    (["rl", "rollout.nn=4"], "config: unknown field rollout.nn"),
    (["rl", "model=nope"], "Could not find 'model/nope' Available options in 'model': glm5_744b tiny"),
    (["rl", "lora.enabled=false"], "lora.enabled=false: the RL trainer trains LoRA adapters"),
    (["rl", "--config", "glm5_744b"], "data.train: the prompt set must be given"),  # no silent toy prompts
    (["sft", "data.train=???"], "config: data.train is missing (???): give it, e.g. data.train=..."),
])
def test_bad_keys_and_values_are_one_line_errors_naming_the_key(capsys, tmp_path, argv, msg):
    out = tmp_path / "run"
    key = "train.out" if argv[0] == "sft" else "trainer.out"
    rc, _, err = _glm5(capsys, *argv, f"{key}={out}", "model.hf_dir=" + str(tmp_path))
    assert rc == 2 and err.startswith(f"glm5 {argv[0]}: error: ") and msg in err and err.count("\n") == 1, err
    assert not out.exists()


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    """Prompts of random words; the response counts up from the first word."""
    import random

    r, path = random.Random(0), tmp_path_factory.mktemp("rows") / "train.jsonl"
    with open(path, "w") as f:
        for _ in range(16):
            a = [r.randrange(90) for _ in range(r.randrange(3, 10))]
            f.write(json.dumps({"prompt": " ".join(f"w{x}" for x in a),
                                "response": " ".join(f"w{a[0] + k}" for k in range(4))}) + "\n")
    return str(path)


def _sft_args(tiny_dir, rows, out):
    return [f"model.hf_dir={tiny_dir}", f"data.train={rows}", "data.micro_batch_tokens=64",
            "data.global_batch_tokens=64", "data.max_tokens=64", "lora.rank=2", "train.steps=2",
            f"train.out={out}", "train.progress=false", "wandb=disabled"]


def test_multirun_runs_each_job_in_its_own_folder_and_the_saved_config_repeats_it(capsys, tmp_path, tiny_dir,
                                                                                  rows):
    sweep = tmp_path / "sweep"
    rc, out, err = _glm5(capsys, "sft", "-m", "optim.lr=1e-3,3e-3", *_sft_args(tiny_dir, rows, sweep))
    assert rc == 0, err
    jobs = [json.loads(x) for x in out.splitlines() if x.startswith("{")]
    assert [j["out"] for j in jobs] == [str(sweep / "0"), str(sweep / "1")]
    assert jobs[0]["losses"][0] == jobs[1]["losses"][0] and jobs[0]["losses"][1] != jobs[1]["losses"][1]
    assert json.loads((sweep / ".glm5-output").read_text())["kind"] == "sft multirun"
    assert (sweep / "multirun.yaml").is_file()
    for n, lr in ((0, 1e-3), (1, 3e-3)):
        saved = yaml.safe_load((sweep / str(n) / ".hydra" / "config.yaml").read_text())
        assert saved["optim"]["lr"] == lr and saved["train"]["out"] == str(sweep / str(n))
        assert json.loads((sweep / str(n) / ".glm5-output").read_text())["kind"] == "sft"
        assert f"optim.lr={lr}" in (sweep / str(n) / ".hydra" / "overrides.yaml").read_text()

    # the saved config repeats job 1 exactly (same losses), in a new folder
    again = tmp_path / "again"
    rc, out, err = _glm5(capsys, "sft", "--config-path", str(sweep / "1" / ".hydra"), "--config-name", "config",
                         f"train.out={again}")
    assert rc == 0, err
    assert json.loads(out.strip().splitlines()[-1])["losses"] == jobs[1]["losses"]
    assert yaml.safe_load((again / ".hydra" / "config.yaml").read_text())["optim"]["lr"] == 3e-3


def test_multirun_folders_obey_the_output_guard(capsys, tmp_path, tiny_dir, rows):
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    before = _tree(other)
    rc, _, err = _glm5(capsys, "sft", "-m", "optim.lr=1e-3,3e-3", *_sft_args(tiny_dir, rows, other))
    assert rc == 2 and "is not empty and not a previous 'sft multirun' output (holds notes.txt)" in err, err
    assert _tree(other) == before and sorted(p.name for p in other.iterdir()) == ["notes.txt"]
    tiny_before = _tree(Path(tiny_dir))
    rc, _, err = _glm5(capsys, "sft", "-m", "optim.lr=1e-3,3e-3", *_sft_args(tiny_dir, rows, tiny_dir))
    assert rc == 2 and f"is the input {tiny_dir}" in err, err
    assert _tree(Path(tiny_dir)) == tiny_before
    rc, _, err = _glm5(capsys, "sft", "-m", *_sft_args(tiny_dir, rows, tmp_path / "x"),
                       f"train.out={tmp_path / 'a'},{tmp_path / 'b'}")
    assert rc == 2 and "train.out: the sweep's root folder" in err, err
    assert not any((tmp_path / n).exists() for n in ("a", "b", "x"))
    # a job refused by the recipe's own checks leaves no config behind in a previous run's folder
    run = tmp_path / "run"
    assert _glm5(capsys, "sft", *_sft_args(tiny_dir, rows, run), "train.save_every=2")[0] == 0
    kept = _tree(run)
    rc, _, err = _glm5(capsys, "sft", *_sft_args(tiny_dir, rows, run), "lora.rank=4", "train.steps=3")
    assert rc == 2 and "lora.rank: 2 -> 4" in err, err
    assert _tree(run) == kept


def test_bad_saved_configs_are_one_line_errors_naming_the_file(capsys, tmp_path):
    """Issue 34 class 14: invalid YAML under ``--config-path`` (was a raw ``ScannerError`` / ``ParserError``
    stack, exit 1) and the other recipe's saved config (was "unknown field trainer") name the file."""
    from omegaconf import OmegaConf

    from recipes.cli import compose

    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.yaml").write_text("model: [unclosed\n  hf_dir: x\n")
    saved = tmp_path / "rl_run" / ".hydra"
    saved.mkdir(parents=True)
    (saved / "config.yaml").write_text(OmegaConf.to_yaml(compose("rl/grpo_tiny", [])))
    for kind in ("sft", "rl"):
        rc, _, err = _glm5(capsys, kind, "--config-path", str(bad), "--config-name", "config")
        assert rc == 2 and err.startswith(f"glm5 {kind}: error: {bad / 'config.yaml'}: not valid YAML (") \
            and "line 2 column" in err and err.count("\n") == 1, err
    rc, _, err = _glm5(capsys, "sft", "--config-path", str(saved), "--config-name", "config")
    assert rc == 2 and err.count("\n") == 1, err
    assert f"{saved / 'config.yaml'}: a glm5 rl config (it has a 'trainer:' section" in err, err
    assert f"run it with glm5 rl --config-path {saved} --config-name config" in err, err

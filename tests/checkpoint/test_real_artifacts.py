"""Artifacts made elsewhere: a GLM-5 folder saved by transformers (no MTP tensors while config.json
declares one), bf16 tensors stored under ``"dtype": "float32"``, and FP8 exports in the release's
block format."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from glm5_mcore.checkpoint.hf_io import HFCheckpoint, SafetensorsFile, dequantize_fp8_blocks

from tests.support.launch import glm5


def _stored(hf_dir) -> dict:
    """{name: (dtype, shape, raw bytes)} of every stored tensor, FP8 undequantized."""
    ck = HFCheckpoint(hf_dir)
    out = {}
    for n in ck.keys():
        f = ck._file(ck.files[n])
        t = f.read(n)
        out[n] = (t.dtype, tuple(t.shape), t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return out


@pytest.fixture(scope="module")
def saved_dir(tmp_path_factory):
    """A tiny GLM-5 (config declares 1 MTP layer) written by transformers' own ``save_pretrained``."""
    from transformers import AutoModelForCausalLM

    from glm5_mcore.tiny import write_tiny

    root = tmp_path_factory.mktemp("saved")
    src = write_tiny(root / "src", mtp=True, seed=3)
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    model.save_pretrained(str(root / "saved"))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(src) / f, root / "saved" / f)
    d = root / "saved"
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 1
    assert not any(k.startswith(f"model.layers.{cfg['num_hidden_layers']}.") for k in HFCheckpoint(d).keys())
    return str(d)


def test_saved_folder_passes_parity_with_a_notice(saved_dir, single_rank, capfd):
    from glm5_mcore.mcore_settings import ParallelConfig
    from glm5_mcore.parity import load_input_ids, run_parity

    ids = load_input_ids(None, 128, 2, 32, seed=4)
    report = run_parity(saved_dir, ids, ParallelConfig())
    assert report["pass"] and report["max_abs"] <= 1e-4, report
    err = capfd.readouterr().err
    notices = [line for line in err.splitlines() if line.startswith("glm5: notice:")]
    assert len(notices) == 1 and "num_nextn_predict_layers=1" in notices[0], err


def test_saved_folder_round_trips_byte_for_byte(saved_dir, tmp_path):
    from glm5_mcore.convert.hf_to_mcore import hf_to_mcore
    from glm5_mcore.convert.mcore_to_hf import mcore_to_hf

    ck = hf_to_mcore(saved_dir, tmp_path / "ck", progress=False)
    back = mcore_to_hf(ck, tmp_path / "back", progress=False)
    a, b = _stored(saved_dir), _stored(back)
    assert sorted(a) == sorted(b)
    assert all(a[k] == b[k] for k in a), [k for k in a if a[k] != b[k]][:3]
    assert json.loads((back / "config.json").read_text())["num_nextn_predict_layers"] == 1


def test_bf16_stored_under_fp32_config_round_trips_to_bf16(saved_dir, tmp_path):
    """Tensors stored bf16 (router fp32) while config.json says float32: they come back bf16, not fp32."""
    from glm5_mcore.convert.hf_to_mcore import hf_to_mcore
    from glm5_mcore.convert.mcore_to_hf import mcore_to_hf

    src = HFCheckpoint(saved_dir)
    d = tmp_path / "bf16"
    d.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(saved_dir) / f, d / f)
    save_file({k: (src.get(k) if k.endswith(("mlp.gate.weight", "e_score_correction_bias")) else
                   src.get(k).bfloat16()) for k in src.keys()}, str(d / "model.safetensors"))
    assert json.loads((d / "config.json").read_text())["dtype"] == "float32"
    back = mcore_to_hf(hf_to_mcore(d, tmp_path / "ck", progress=False), tmp_path / "back", progress=False)
    a, b = _stored(d), _stored(back)
    assert sorted(a) == sorted(b) and all(a[k] == b[k] for k in a)
    assert sum(f.stat().st_size for f in back.glob("*.safetensors")) < 1.01 * (d / "model.safetensors").stat().st_size
    assert json.loads((back / "config.json").read_text())["dtype"] == "bfloat16"
    # --dtype overrides the record (the router stays fp32)
    fp32 = _stored(mcore_to_hf(tmp_path / "ck", tmp_path / "fp32", progress=False, dtype="fp32"))
    assert {v[0] for v in fp32.values()} == {torch.float32}


@pytest.mark.slow
def test_fp8_export_reimports_to_its_dequantized_values(saved_dir, tmp_path):
    """FP8 export: e4m3 + 128x128 fp32 weight_scale_inv on the projections, the rest kept; import of the
    export is exactly q·s, within e4m3's bound of the source; exporting that import again is byte-identical."""
    import subprocess
    import sys

    from glm5_mcore.convert.hf_to_mcore import hf_to_mcore
    from glm5_mcore.checkpoint.fp8 import is_quantized

    # widths past one 128 block (partial edge blocks): hidden 192, intermediate 160
    from glm5_mcore.config import glm5_tiny
    from glm5_mcore.tiny import random_hf_state_dict, write_hf_checkpoint
    import dataclasses

    cfg = dataclasses.replace(glm5_tiny(), hidden_size=192, intermediate_size=160, vocab_size=300)
    src = write_hf_checkpoint(cfg, {k: v.bfloat16() if not k.endswith(("mlp.gate.weight", "e_score_correction_bias"))
                                    else v for k, v in random_hf_state_dict(cfg, 5).items()}, tmp_path / "src")
    ck = hf_to_mcore(src, tmp_path / "ck", progress=False)
    glm5("convert", "mcore-to-hf", "--no-progress", "--ckpt", ck, "--out", tmp_path / "fp8", "--dtype", "fp8", timeout=300)
    fp8 = Path(tmp_path / "fp8")
    qc = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    assert qc == {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    stored, source, got = _stored(fp8), HFCheckpoint(src), HFCheckpoint(fp8)
    n_q = 0
    for name in source.keys():
        if is_quantized(name):
            n_q += 1
            assert stored[name][0] == torch.float8_e4m3fn and stored[name + "_scale_inv"][0] == torch.float32
            f = SafetensorsFile(got.files[name])
            q, s = f.read(name), SafetensorsFile(got.files[name + "_scale_inv"]).read(name + "_scale_inv")
            assert torch.equal(got.get(name), dequantize_fp8_blocks(q, s))  # import = q·s exactly
            w = source.get(name).float()
            err = (got.get(name) - w).abs()
            scale = s.repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)[:, :w.shape[1]]
            # half an e4m3 ulp: 2^-4 relative (normals), 2^-10·s absolute (subnormals)
            assert (err <= torch.maximum(w.abs() / 16, scale * 2.0 ** -10) * (1 + 1e-6)).all(), name
        else:
            assert name + "_scale_inv" not in stored
            assert stored[name][0] == (torch.float32 if name.endswith(("mlp.gate.weight", "e_score_correction_bias"))
                                       else torch.bfloat16), name
            assert torch.equal(got.get(name), source.get(name)), name
    assert n_q > 0 and stored["model.layers.0.mlp.gate_proj.weight_scale_inv"][1] == (2, 2)  # 160x192: partial blocks
    # import ∘ export: the FP8 folder converts and exports back byte-identically (scales and bytes)
    from glm5_mcore.convert.mcore_to_hf import mcore_to_hf

    mcore_to_hf(hf_to_mcore(fp8, tmp_path / "ck8", progress=False), tmp_path / "fp8b", progress=False)
    assert _stored(tmp_path / "fp8b") == stored


def _sft_cfg(hf_dir, tmp_path, **over):
    from recipes.sft import SFTConfig

    data = Path(tmp_path) / "train.jsonl"
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1}", "response": f"w{i + 2} w{i + 3}"}) + "\n"
                            for i in range(16)))
    d = {"model": {"hf_dir": hf_dir}, "data": {"train": str(data), "micro_batch_tokens": 64,
                                               "global_batch_tokens": 128, "max_tokens": 32},
         "optim": {"lr": 3e-3, "decay_style": "constant"}, "lora": {"enabled": False},
         "train": {"steps": 2, "out": str(tmp_path / "run"), "save_every": 2, "progress": False},
         "wandb": {"mode": "disabled"}}
    for k, v in over.items():
        d.setdefault(k, {}).update(v)
    return SFTConfig.from_dict(d)


def test_saved_folder_fine_tunes_without_mtp_or_with_a_fresh_one(saved_dir, tmp_path):
    """model.mtp=auto: no MTP block, no MTP loss, the export holds the tensors read; model.mtp=init: a
    fresh MTP layer (Megatron-Core's init) is trained and exported as model.layers.{L}.*."""
    from glm5_mcore.convert.mcore_to_hf import mcore_to_hf
    from recipes.sft import run

    L = json.loads((Path(saved_dir) / "config.json").read_text())["num_hidden_layers"]
    auto = run(_sft_cfg(saved_dir, tmp_path / "auto"))
    assert all("mtp_loss/depth_1" not in m for m in auto["history"]), auto["history"][-1]
    names = HFCheckpoint(mcore_to_hf(tmp_path / "auto" / "run", tmp_path / "auto_hf", progress=False)).keys()
    assert sorted(names) == sorted(HFCheckpoint(saved_dir).keys())

    from recipes.cli import compose

    assert compose("sft", ["model.mtp=init", "data.train=x"])["model"]["mtp"] == "init"  # glm5 sft model.mtp=init
    init = run(_sft_cfg(saved_dir, tmp_path / "init", model={"mtp": "init"}))
    assert all(m["mtp_loss/depth_1"] > 0 for m in init["history"]), init["history"][-1]
    back = HFCheckpoint(mcore_to_hf(tmp_path / "init" / "run", tmp_path / "init_hf", progress=False))
    mtp = [n for n in back.keys() if n.startswith(f"model.layers.{L}.")]
    assert f"model.layers.{L}.eh_proj.weight" in mtp and len(mtp) == len(back.keys()) - len(HFCheckpoint(saved_dir).keys())


@pytest.mark.slow
def test_saved_folder_lora_exports_and_is_an_rl_base(saved_dir, tmp_path):
    """Converted, then a LoRA run from the checkpoint (adapters only in its own folder; the base weights
    found through the recorded base checkpoint): exports as PEFT and
    merged (no MTP tensors invented); the RL trainer and the transformers engine load the folder and
    agree on sampled log-probs."""
    import subprocess
    import sys

    from recipes.sft import run
    from rl.config import RLConfig
    from rl.rollout.base import Request, SamplingParams, sample_seed
    from rl.rollout.hf_engine import HFRolloutEngine
    from rl.train.trainer import PolicyTrainer

    from glm5_mcore.convert.hf_to_mcore import hf_to_mcore

    ck = hf_to_mcore(saved_dir, tmp_path / "base", progress=False)
    run(_sft_cfg(saved_dir, tmp_path, model={"hf_dir": None, "ckpt": str(ck)}, lora={"enabled": True, "rank": 4},
                 train={"resume": False}))
    for extra, out in (([], "peft"), (["--merged"], "merged")):
        glm5("lora", "export", "--ckpt", tmp_path / "run", "--no-progress", *extra, "--out", tmp_path / out, timeout=300)
    assert (tmp_path / "peft" / "adapter_model.safetensors").is_file()
    assert sorted(HFCheckpoint(tmp_path / "merged").keys()) == sorted(HFCheckpoint(saved_dir).keys())

    cfg = RLConfig.from_dict({"model": {"hf_dir": saved_dir}, "wandb": {"mode": "disabled"},
                              "rollout": {"temperature": 0.8, "max_new_tokens": 8}})
    trainer = PolicyTrainer(cfg)
    engine = HFRolloutEngine(saved_dir)
    engine.load_adapter(trainer.export_adapter(1))
    from rl.train.batch import fill_log_probs, make_batch
    from rl.tasks.prompts import toy_prompts
    from transformers import AutoTokenizer

    prompts = toy_prompts(AutoTokenizer.from_pretrained(saved_dir), 2, seed=0)
    reqs = [Request((p.index, k), p.ids, sample_seed(1, 0, p.index, k)) for p in prompts for k in range(2)]
    results = engine.generate(reqs, SamplingParams(0.8, 1.0, 8, ()))
    batch = make_batch(prompts, results, 2)
    fill_log_probs(batch, [trainer.compute_log_probs(batch, ref=False)])
    diff = (batch.old_log_probs - batch.rollout_log_probs)[batch.response_mask.bool()].abs()
    assert float(diff.max()) <= 1e-5, float(diff.max())


@pytest.mark.slow
def test_bad_dtype_record_and_mtp_mode_name_the_problem(saved_dir, tmp_path):
    """A corrupt hf/dtypes.json: exit 2 naming the file, no output folder; model.mtp=bogus names the field."""
    import subprocess
    import sys

    from glm5_mcore.convert.hf_to_mcore import hf_to_mcore
    from recipes.sft import run

    ck = hf_to_mcore(saved_dir, tmp_path / "ck", progress=False)
    (ck / "hf" / "dtypes.json").write_text("{not json")
    r = glm5("convert", "mcore-to-hf", "--ckpt", ck, "--out", tmp_path / "out", "--no-progress", ok=False, timeout=300)
    assert r.returncode == 2 and f"error: {ck / 'hf' / 'dtypes.json'}: not a dtype record" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match="model.mtp: expected auto, init or off"):
        run(_sft_cfg(saved_dir, tmp_path / "bad", model={"mtp": "bogus"}))
    with pytest.raises(ValueError, match="model.mtp=init trains a whole fresh MTP layer.*lora.enabled=false"):
        run(_sft_cfg(saved_dir, tmp_path / "bad", model={"mtp": "init"}, lora={"enabled": True}))
    assert not (tmp_path / "bad" / "run").exists()

"""Checkpoints that travel: folders in Megatron-LM's and Megatron-Bridge's layout (built here the way
their trainers save: ``tests/support/megatron_layout.py``) load into parity, conversion and training and
match the weights they were saved from; ``glm5 checkpoint export --format megatron`` writes ours in
their layout."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from recipes.main import main as cli
from glm5_mcore.checkpoint.hf_io import HFCheckpoint

from tests.support.megatron_layout import write_megatron
from tests.support.launch import glm5, last_json

ROUTER = ("mlp.gate.weight",)


def _tensors(hf_dir) -> dict:
    ck = HFCheckpoint(hf_dir)
    return {k: ck.get(k) for k in ck.keys()}


@pytest.fixture(scope="module")
def foreign(tiny_mtp_dir, tmp_path_factory):
    """{"mlm": Megatron-LM folder (fp32 weights, bf16 router, MTP, args in the common state),
    "bridge": Bridge folder (bf16 weights incl. router, MTP dropped as Bridge does by default,
    run_config.yaml, tokenizer/, train_state.pt), "src": the HF tensors they were saved from}."""
    from tests.support.helpers import hf_model

    root = tmp_path_factory.mktemp("foreign")
    src, _ = hf_model(tiny_mtp_dir)
    write_megatron(root / "mlm", src, 20, flavour="megatron-lm")
    src_bf, _ = hf_model(tiny_mtp_dir, bf16=True, params_dtype=torch.bfloat16)
    write_megatron(root / "bridge", src_bf, 30, flavour="bridge", drop_mtp=True, hf_dir=tiny_mtp_dir)
    return {"mlm": root / "mlm", "bridge": root / "bridge", "src": _tensors(tiny_mtp_dir), "root": root}


def _expected(src: dict, flavour: str, n_layers: int) -> dict:
    """What each folder holds of the HF source: the router rounded to bf16 (both), everything in bf16
    and no MTP layer (Bridge)."""
    out = {}
    for k, v in src.items():
        if flavour == "bridge":
            if k.startswith(f"model.layers.{n_layers}."):  # the MTP layer
                continue
            out[k] = v if k.endswith("e_score_correction_bias") else v.bfloat16()
            if k.endswith(ROUTER):
                out[k] = v.bfloat16().float()
        else:
            out[k] = v.bfloat16().float() if k.endswith(ROUTER) else v
    return out


def test_layout_resolution_and_bad_tracker(foreign, tmp_path):
    from glm5_mcore.checkpoint.layout import model_dir
    from glm5_mcore.checkpoint.megatron_lm import is_foreign

    assert is_foreign(foreign["mlm"]) and is_foreign(foreign["bridge"] / "iter_0000030")
    assert model_dir(foreign["mlm"]) == foreign["mlm"] / "iter_0000020"  # via the tracker file
    assert model_dir(foreign["bridge"] / "iter_0000030") == foreign["bridge"] / "iter_0000030"
    bad = tmp_path / "bad"
    shutil.copytree(foreign["mlm"], bad)
    (bad / "latest_checkpointed_iteration.txt").write_text("twenty\n")
    with pytest.raises(ValueError, match="latest_checkpointed_iteration.txt: expected an iteration number"):
        model_dir(bad)
    (bad / "latest_checkpointed_iteration.txt").write_text("release\n")
    with pytest.raises(FileNotFoundError, match="release: named by"):
        model_dir(bad)
    with pytest.raises(FileNotFoundError, match=r"iteration 7 does not exist .*\[20\]"):
        model_dir(bad, 7)


@pytest.mark.parametrize("flavour", ["mlm", "bridge"])
def test_training_loader_gets_the_source_weights(foreign, tiny_mtp_dir, flavour, single_rank, capsys):
    """``load_model`` (SFT/RL ``model.ckpt``, parity ``--ckpt``): their non-tensor state is left out, the
    bf16 router upcast; every parameter equals the one saved."""
    from glm5_mcore.checkpoint.dist import load_model
    from glm5_mcore.checkpoint.layout import model_dir
    from glm5_mcore.config import GLM5Config
    from glm5_mcore.checkpoint.megatron_lm import glm5_config
    from glm5_mcore.model.build import build_model
    from tests.support.helpers import hf_model

    cfg = glm5_config(foreign[flavour], GLM5Config.from_hf_dir(tiny_mtp_dir))
    assert cfg.num_nextn_predict_layers == (1 if flavour == "mlm" else 0)
    err = capsys.readouterr().err
    assert "no checksum manifest, loaded unverified" in err
    assert ("no MTP tensors" in err) == (flavour == "bridge")
    m = build_model(cfg, None)
    load_model(m, model_dir(foreign[flavour]))
    ref, _ = hf_model(tiny_mtp_dir, **({"bf16": True, "params_dtype": torch.bfloat16} if flavour == "bridge" else {}))
    ref = dict(ref.named_parameters())
    n = 0
    for k, p in m.named_parameters():
        r = ref[k].detach()
        r = r.bfloat16() if k.endswith("router.weight") else r
        assert p.dtype == torch.float32 and torch.equal(p.detach(), r.float()), k
        n += 1
    assert n == len(ref) - (sum(1 for k in ref if k.startswith("mtp.")) if flavour == "bridge" else 0)


def test_architecture_is_checked_against_the_hf_config(foreign, tiny_mtp_dir, tmp_path):
    from glm5_mcore.config import GLM5Config
    from glm5_mcore.checkpoint.megatron_lm import glm5_config

    hf = GLM5Config.from_hf_dir(tiny_mtp_dir)
    for flavour, edit in (("bridge", "run_config"), ("mlm", "hf")):
        bad = tmp_path / flavour
        shutil.copytree(foreign[flavour], bad)
        if edit == "run_config":
            rc = next(bad.glob("iter_*/run_config.yaml"))
            d = yaml.safe_load(rc.read_text())
            d["model"]["num_moe_experts"] = hf.n_routed_experts * 2
            rc.write_text(yaml.safe_dump(d))
            with pytest.raises(ValueError, match=rf"run_config.yaml: n_routed_experts = {hf.n_routed_experts * 2} "
                                                 rf"but the HF config says {hf.n_routed_experts}"):
                glm5_config(bad, hf)
        else:
            other = GLM5Config.from_hf_dict({**hf.to_hf_dict(), "kv_lora_rank": hf.kv_lora_rank + 8})
            with pytest.raises(ValueError, match=r"Megatron-LM args\): kv_lora_rank = \d+ but the HF config says"):
                glm5_config(bad, other)


def test_a_megatron_lm_folder_with_a_padded_vocabulary_loads_the_real_rows(tiny_odd_dir, tmp_path, single_rank,
                                                                           capsys):
    """Megatron-LM pads the tokenizer's 129 ids to 256 rows (``make_vocab_size_divisible_by`` 128) and records
    only ``padded_vocab_size``: read against the HF config it is that vocabulary padded (said once), and the
    model built at 129 rows loads it: every parameter the one saved (the embedding and output layer its first
    129 rows, the router as Megatron stores it, bf16) (was: ``vocab_size = 256 but the HF config says 129``)."""
    from glm5_mcore.checkpoint.dist import load_model
    from glm5_mcore.checkpoint.layout import model_dir
    from glm5_mcore.checkpoint.megatron_lm import glm5_config
    from glm5_mcore.config import GLM5Config
    from glm5_mcore.mcore_settings import ParallelConfig
    from glm5_mcore.model.build import build_model
    from glm5_mcore.model.vocab import VOCAB_PARALLEL
    from tests.support.helpers import hf_model

    padded, _ = hf_model(tiny_odd_dir, ParallelConfig(make_vocab_size_divisible_by=128))
    assert padded.vocab_size == 256
    write_megatron(tmp_path / "mlm", padded, 5, flavour="megatron-lm")
    hf = GLM5Config.from_hf_dir(tiny_odd_dir)
    cfg = glm5_config(tmp_path / "mlm", hf)
    assert cfg.vocab_size == 129 and "padded_vocab_size=256 is Megatron-LM's padding" in capsys.readouterr().err
    m = build_model(cfg)
    load_model(m, model_dir(tmp_path / "mlm"))
    assert m.output_layer.weight.shape == (129, 64)
    saved = dict(padded.named_parameters())
    for k, p in m.named_parameters():
        r = saved[k].detach()[:129] if k in VOCAB_PARALLEL else saved[k].detach()
        r = r.bfloat16().float() if k.endswith("router.weight") else r
        assert torch.equal(p.detach(), r), k


@pytest.fixture(scope="module")
def converted(foreign):
    out = {}
    for flavour in ("mlm", "bridge"):
        out[flavour] = foreign["root"] / f"hf_{flavour}"
        assert cli(["convert", "mcore-to-hf", "--ckpt", str(foreign[flavour]), "--out", str(out[flavour]),
                    "--no-progress"]) == 0
    return out


@pytest.mark.parametrize("flavour", ["mlm", "bridge"])
def test_mcore_to_hf_writes_the_source_weights(foreign, converted, tiny_mtp_dir, flavour):
    got = _tensors(converted[flavour])
    ref = json.loads((Path(tiny_mtp_dir) / "config.json").read_text())
    want = _expected(foreign["src"], flavour, ref["num_hidden_layers"])
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    cfg = json.loads((converted[flavour] / "config.json").read_text())
    for k in ("hidden_size", "n_routed_experts", "num_hidden_layers", "kv_lora_rank", "index_topk", "vocab_size"):
        assert cfg[k] == ref[k], k
    assert cfg["num_nextn_predict_layers"] == (1 if flavour == "mlm" else 0)
    if flavour == "bridge":  # no HF folder anywhere: architecture from run_config.yaml, tokenizer from tokenizer/
        assert (converted[flavour] / "tokenizer.json").read_bytes() == (Path(tiny_mtp_dir) / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("flavour", ["mlm", "bridge"])
def test_parity_on_their_folders(foreign, converted, flavour):
    from glm5_mcore.mcore_settings import ParallelConfig
    from glm5_mcore.parity import load_input_ids, run_parity

    ids = load_input_ids(None, 128, 2, 32, seed=5)
    rep = run_parity(str(converted[flavour]), ids, ParallelConfig(), ckpt=str(foreign[flavour]))
    assert rep["pass"] and rep["max_abs"] <= 1e-4 and rep["topk_agree"] == 1.0 and rep["router_agree"] == 1.0, rep


@pytest.mark.slow
def test_parity_on_a_megatron_lm_folder_at_tp2_ep2(foreign, converted):
    r = glm5("parity", "--ckpt", foreign["mlm"], "--hf-dir", converted["mlm"], "--tp", "2", "--ep", "2", nproc=2)
    rep = last_json(r.stdout)
    assert rep["tp"] == 2 and rep["ep"] == 2 and rep["max_abs"] <= 1e-4 and rep["topk_agree"] == 1.0, rep
    assert r.stderr.count("no checksum manifest, loaded unverified") == 1  # said once, by rank 0


def test_parity_on_their_folder_needs_the_hf_weights(foreign, capsys):
    assert cli(["parity", "--ckpt", str(foreign["bridge"])]) == 2
    assert "pass --hf-dir with the HF weights" in capsys.readouterr().err


def test_sft_starts_from_a_bridge_folder_exactly_as_from_its_weights(foreign, converted, tmp_path):
    """SFT with ``model.ckpt`` = the Bridge folder takes the same steps as SFT on the same weights as HF."""
    from recipes.sft import run
    from tests.support.sft_setup import sft_cfg

    a = run(sft_cfg(str(converted["bridge"]), tmp_path / "a", train={"steps": 2, "eval_every": 0}))["history"]
    b = run(sft_cfg(str(converted["bridge"]), tmp_path / "b", model={"ckpt": str(foreign["bridge"])},
                 train={"steps": 2, "eval_every": 0}))["history"]
    assert [x["loss"] for x in a] == [x["loss"] for x in b]


def test_sft_checks_a_bridge_folders_config_against_model_hf_dir(foreign, tiny_mtp_dir, tmp_path):
    """Issue 34 class 9: SFT on a Bridge folder whose ``run_config.yaml`` disagrees with ``model.hf_dir`` is
    refused naming the file and field before the run folder is claimed (as parity and RL refuse it)."""
    from glm5_mcore.config import GLM5Config
    from recipes.sft import run
    from tests.support.sft_setup import sft_cfg

    experts = GLM5Config.from_hf_dir(tiny_mtp_dir).n_routed_experts
    bad = tmp_path / "bad"
    shutil.copytree(foreign["bridge"], bad)
    rc = next(bad.glob("iter_*/run_config.yaml"))
    d = yaml.safe_load(rc.read_text())
    d["model"]["num_moe_experts"] = experts * 2
    rc.write_text(yaml.safe_dump(d))
    cfg = sft_cfg(tiny_mtp_dir, tmp_path / "s", model={"ckpt": str(bad)}, train={"steps": 1, "eval_every": 0})
    with pytest.raises(ValueError, match=rf"run_config.yaml: n_routed_experts = {experts * 2} but the HF config"):
        run(cfg)
    assert not (tmp_path / "s" / "run").exists()


def test_rl_trainer_starts_from_a_megatron_lm_folder(foreign, tiny_mtp_dir):
    """RL's ``model.ckpt``: the policy's base weights are the Megatron-LM folder's (router upcast)."""
    from rl.config import RLConfig
    from rl.train.trainer import PolicyTrainer

    def base(**model):
        t = PolicyTrainer(RLConfig.from_dict({"model": {"hf_dir": tiny_mtp_dir, **model},
                                              "wandb": {"mode": "disabled"}}))
        return {k: p.detach().clone() for k, p in t.model.named_parameters() if ".lora." not in k}

    ref, got = base(), base(ckpt=str(foreign["mlm"]))
    assert sorted(ref) == sorted(got)
    for k, v in ref.items():
        assert torch.equal(got[k], v.bfloat16().float() if k.endswith("router.weight") else v), k


def test_bad_foreign_inputs_are_one_line_errors_and_write_nothing(foreign, tmp_path, capsys):
    bad = tmp_path / "bad"
    shutil.copytree(foreign["bridge"], bad)
    (bad / "iter_0000030" / "run_config.yaml").write_text("model: [unclosed\n")
    assert cli(["convert", "mcore-to-hf", "--ckpt", str(bad), "--out", str(tmp_path / "o1"), "--no-progress"]) == 2
    assert "run_config.yaml: not valid YAML" in capsys.readouterr().err
    legacy = tmp_path / "legacy"
    (legacy / "iter_0000005" / "mp_rank_00").mkdir(parents=True)
    (legacy / "iter_0000005" / "mp_rank_00" / "model_optim_rng.pt").write_bytes(b"x")
    (legacy / "latest_checkpointed_iteration.txt").write_text("5")
    assert cli(["convert", "mcore-to-hf", "--ckpt", str(legacy), "--out", str(tmp_path / "o2"), "--no-progress"]) == 2
    assert "legacy torch format (mp_rank_*/model_optim_rng.pt) is not read" in capsys.readouterr().err
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()
    assert cli(["sft", f"model.ckpt={foreign['bridge']}", "data.train=x.jsonl", f"train.out={tmp_path / 'r'}"]) == 2
    assert "a Megatron-LM / Megatron-Bridge checkpoint; give model.hf_dir too" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_lora_export_on_a_full_megatron_checkpoint_says_there_is_no_adapter(foreign, tmp_path, capsys):
    for flavour, kind in (("bridge", "Megatron-Bridge"), ("mlm", "Megatron-LM")):
        assert cli(["lora", "export", "--ckpt", str(foreign[flavour]), "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("glm5 lora: error: ")
        assert f"a {kind} checkpoint with no LoRA adapter in it" in err
        assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def bridge_lora(foreign, tiny_mtp_dir):
    """A known adapter on every GLM-5 LoRA family (distinct per expert, MTP layer included), its values
    bf16 (Bridge keeps adapters in the params dtype), saved as a Megatron-Bridge PEFT checkpoint whose
    base (run_config.yaml checkpoint.pretrained_checkpoint) is the Megatron-LM folder of the same model;
    dense / shared-expert fc1 as CanonicalLoRA gate/up halves."""
    from glm5_mcore.lora.state import gather_adapter
    from glm5_mcore.mcore_settings import ParallelConfig
    from glm5_mcore.lora.config import FAMILIES, LoRAConfig
    from glm5_mcore.lora.apply import apply_lora
    from glm5_mcore.model.parallel import init_parallel
    from tests.support.helpers import hf_model
    from tests.support.megatron_layout import write_bridge_peft

    init_parallel(ParallelConfig())
    model, _ = hf_model(tiny_mtp_dir)
    apply_lora(model, LoRAConfig(rank=4, alpha=8, targets=FAMILIES, init="random"), "default", freeze_indexer=False)
    state = gather_adapter(model, "default")
    for k in state.modules():
        state.A[k], state.B[k] = state.A[k].bfloat16().float(), state.B[k].bfloat16().float()
    root = foreign["root"] / "bridge_lora"
    write_bridge_peft(root, state, model, 40, alpha=8, pretrained=foreign["mlm"], hf_dir=tiny_mtp_dir,
                      canonical_fc1=True)
    return root, state


def test_lora_export_reads_a_bridge_peft_checkpoint(bridge_lora, tiny_mtp_dir, tmp_path, single_rank):
    """Their adapter tensors (names, expert axis, SwiGLU halves, CanonicalLoRA halves, alpha / dim from
    run_config.yaml) become the HF PEFT folder our own export of the source adapter gives, bit for bit;
    peft loads it with no missing or unexpected keys and computes what our model with the adapter does."""
    from safetensors.torch import load_file

    from glm5_mcore.config import GLM5Config
    from glm5_mcore.lora.bridge_peft import read_bridge_adapter
    from glm5_mcore.lora.peft import export_peft
    from tests.support.helpers import hf_model, peft_model

    root, src = bridge_lora
    got = read_bridge_adapter(root)
    assert sorted(got.state.modules()) == sorted(src.modules())
    for k in src.modules():
        assert torch.equal(got.state.A[k], src.A[k]) and torch.equal(got.state.B[k], src.B[k]), k
        assert got.state.scale[k] == 2.0, k
    assert cli(["lora", "export", "--ckpt", str(root), "--out", str(tmp_path / "peft")]) == 0
    hf = GLM5Config.from_hf_dir(tiny_mtp_dir)
    ref = export_peft(src, hf.num_hidden_layers, hf.n_routed_experts, tmp_path / "ref")
    a = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    b = load_file(str(ref / "adapter_model.safetensors"))
    assert sorted(a) == sorted(b) and len(a) > 50
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0
    ca = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    cb = json.loads((ref / "adapter_config.json").read_text())
    assert ca.pop("base_model_name_or_path") == str(tiny_mtp_dir)
    cb.pop("base_model_name_or_path")
    assert ca == cb
    pm, unexpected, missing = peft_model(tiny_mtp_dir, tmp_path / "peft")
    assert unexpected == [] and missing == []
    from glm5_mcore.lora.state import load_adapter_state
    from glm5_mcore.model.build import forward_logits
    from glm5_mcore.parity import load_input_ids

    ours, _ = hf_model(tiny_mtp_dir)
    load_adapter_state(ours, src, "default", trainable=False)
    ids = load_input_ids(None, 128, 2, 24, seed=6)
    with torch.no_grad():
        diff = (pm(ids).logits - forward_logits(ours.eval(), ids)).abs().max().item()
    assert diff <= 1e-4, diff


def test_lora_export_merged_from_a_bridge_peft_checkpoint_equals_peft_merge(bridge_lora, tiny_mtp_dir, tmp_path):
    """``--merged`` onto the base its run_config.yaml names: every weight equals peft's
    ``merge_and_unload`` of the exported adapter on the same base (the router as that base stores it, bf16)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, _ = bridge_lora
    assert cli(["lora", "export", "--ckpt", str(root), "--out", str(tmp_path / "peft")]) == 0
    assert cli(["lora", "export", "--ckpt", str(root), "--merged", "--out", str(tmp_path / "merged"),
                "--no-progress"]) == 0
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_mtp_dir, dtype=torch.float32)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    theirs = PeftModel.from_pretrained(base, str(tmp_path / "peft")).merge_and_unload().state_dict()
    assert sorted(ours) == sorted(theirs)
    worst, changed = 0.0, 0
    for k, v in theirs.items():
        want = v.bfloat16().float() if k.endswith(ROUTER) else v
        worst = max(worst, (ours[k] - want).abs().max().item())
        changed += int(not torch.equal(before[k], v))
    assert worst <= 1e-5 and changed > 20, (worst, changed)


def test_bridge_peft_variants_and_bad_adapters(bridge_lora, foreign, tiny_mtp_dir, tmp_path, capsys):
    """Bridge's shared expert adapter (expert-axis and legacy 2-D layouts) reaches every expert; a LoRA
    with no GLM-5 counterpart (the router), DoRA, and an adapter-only folder given as base weights are
    one-line errors naming the tensor / field, with nothing written."""
    from glm5_mcore.lora.state import AdapterState
    from glm5_mcore.lora.bridge_peft import read_bridge_adapter
    from tests.support.megatron_layout import write_bridge_peft

    _, src = bridge_lora
    from tests.support.helpers import hf_model

    model, _ = hf_model(tiny_mtp_dir)
    e0 = "decoder.layers.1.mlp.experts.local_experts.0.linear_fc1"
    for layout in ("shared", "legacy"):
        root = write_bridge_peft(tmp_path / layout, src, model, 7, alpha=8, pretrained=None, hf_dir=tiny_mtp_dir,
                                 experts=layout)
        got = read_bridge_adapter(root).state
        for e in range(8):
            k = e0.replace("local_experts.0", f"local_experts.{e}")
            assert torch.equal(got.A[k], src.A[e0]) and torch.equal(got.B[k], src.B[e0]), (layout, k)
        assert torch.equal(got.B["decoder.layers.0.mlp.linear_fc1"], src.B["decoder.layers.0.mlp.linear_fc1"])
    capsys.readouterr()
    assert cli(["lora", "export", "--ckpt", str(tmp_path / "legacy"), "--merged", "--out", str(tmp_path / "o")]) == 2
    assert "names no checkpoint.pretrained_checkpoint; pass --base DIR" in capsys.readouterr().err
    one = AdapterState({"decoder.layers.0.mlp.linear_fc2": src.A["decoder.layers.0.mlp.linear_fc2"]},
                       {"decoder.layers.0.mlp.linear_fc2": src.B["decoder.layers.0.mlp.linear_fc2"]}, {})
    router = write_bridge_peft(tmp_path / "router", one, model, 3, alpha=8, pretrained=None, hf_dir=tiny_mtp_dir,
                               extra={"decoder.layers.1.mlp.router.adapter.linear_in.weight": torch.ones(4, 64),
                                      "decoder.layers.1.mlp.router.adapter.linear_out.weight": torch.ones(8, 4)})
    dora = write_bridge_peft(tmp_path / "dora", one, model, 3, alpha=8, pretrained=None, hf_dir=tiny_mtp_dir,
                             peft_target="megatron.bridge.peft.dora.DoRA")
    for ckpt, want in ((router, "tensor decoder.layers.1.mlp.router.adapter.linear_in.weight: LoRA on "
                                "decoder.layers.1.mlp.router has no counterpart"),
                       (dora, "run_config.yaml: peft._target_ 'megatron.bridge.peft.dora.DoRA' is not read")):
        assert cli(["lora", "export", "--ckpt", str(ckpt), "--out", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and want in err, err
        assert not (tmp_path / "o").exists()
    assert cli(["convert", "mcore-to-hf", "--ckpt", str(router), "--out", str(tmp_path / "o"), "--no-progress"]) == 2
    assert "holds LoRA adapter tensors only (a Megatron-Bridge PEFT checkpoint)" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_export_megatron_round_trip(tiny_mtp_dir, tmp_path, capsys, single_rank):
    """Ours -> their layout (tracker, iter_N = the distributed checkpoint, run_config.yaml, tokenizer/),
    which our foreign-layout loaders read back bit for bit; a second export into it is allowed,
    anything else there is refused untouched."""
    from glm5_mcore.checkpoint.dist import load_model
    from glm5_mcore.checkpoint.layout import model_dir
    from glm5_mcore.convert.hf_to_mcore import hf_to_mcore
    from glm5_mcore.checkpoint.megatron_lm import glm5_config, model_path
    from glm5_mcore.model.build import build_model
    from glm5_mcore.config import GLM5Config

    ours = hf_to_mcore(tiny_mtp_dir, tmp_path / "ours", progress=False)
    out = tmp_path / "meg"
    assert cli(["checkpoint", "export", "--format", "megatron", "--ckpt", str(ours), "--out", str(out)]) == 0
    it = out / "iter_0000000"
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "0\n"
    assert model_path(out) == it and (it / "metadata.json").is_file() and (it / ".metadata").is_file()
    assert (it / "tokenizer" / "tokenizer.json").is_file()
    rc = yaml.safe_load((it / "run_config.yaml").read_text())
    assert rc["model"]["_target_"] == "megatron.bridge.models.mla_provider.MLAModelProvider"
    assert rc["model"]["mtp_num_layers"] == 1 and rc["model"]["experimental_attention_variant"] == "dsa"
    assert cli(["checkpoint", "verify", str(out)]) == 0
    hf = GLM5Config.from_hf_dir(tiny_mtp_dir)
    cfg = glm5_config(out, hf)  # run_config.yaml agrees with the HF config
    a, b = build_model(cfg, None), build_model(hf, None)
    load_model(a, model_dir(out))
    load_model(b, model_dir(ours))
    for (k, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), k
    assert cli(["checkpoint", "export", "--format", "megatron", "--ckpt", str(ours), "--out", str(out)]) == 0
    other = tmp_path / "other"
    other.mkdir()
    (other / "keep.txt").write_text("mine")
    capsys.readouterr()
    assert cli(["checkpoint", "export", "--format", "megatron", "--ckpt", str(ours), "--out", str(other)]) == 2
    assert "glm5 checkpoint: error:" in capsys.readouterr().err
    assert (other / "keep.txt").read_text() == "mine"


def test_export_megatron_merges_a_lora_result(tiny_dir, tmp_path, single_rank):
    """A LoRA SFT result exported with --merge-adapter: the Megatron folder computes what the base
    plus the adapter computes."""
    from glm5_mcore.lora.state import load_adapter_state, read_adapter_state
    from glm5_mcore.checkpoint.layout import adapter_dir, model_dir
    from glm5_mcore.checkpoint.dist import load_model
    from glm5_mcore.config import GLM5Config
    from glm5_mcore.checkpoint.megatron_lm import glm5_config
    from glm5_mcore.model.build import build_model, forward_logits
    from glm5_mcore.checkpoint.hf_load import load_hf_weights
    from recipes.sft import run
    from tests.support.sft_setup import sft_cfg

    run(sft_cfg(tiny_dir, tmp_path, lora={"enabled": True, "rank": 4},
             train={"steps": 2, "save_every": 2, "eval_every": 0}))
    ckpt, out = tmp_path / "run", tmp_path / "meg"
    assert cli(["checkpoint", "export", "--format", "megatron", "--ckpt", str(ckpt), "--merge-adapter",
                "default", "--out", str(out)]) == 0
    assert (out / "iter_0000002" / "metadata.json").is_file() and not list(tmp_path.glob(".glm5-export-*"))
    hf = GLM5Config.from_hf_dir(tiny_dir)
    ids = torch.randint(0, hf.vocab_size, (2, 24), generator=torch.Generator().manual_seed(3))
    ref = build_model(hf, None)
    load_hf_weights(ref, tiny_dir, hf)
    load_adapter_state(ref, read_adapter_state(adapter_dir(ckpt, "default")), "default", trainable=False)
    merged = build_model(glm5_config(out, hf), None)
    load_model(merged, model_dir(out))
    with torch.no_grad():
        a, b = forward_logits(ref.eval(), ids), forward_logits(merged.eval(), ids)
        base = build_model(hf, None)
        load_hf_weights(base, tiny_dir, hf)
        c = forward_logits(base.eval(), ids)
    assert (a - b).abs().max() <= 1e-5 and (a - c).abs().max() > 1e-3

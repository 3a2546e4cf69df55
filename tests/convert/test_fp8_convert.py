"""A frozen FP8 base through conversion (``checkpoint.fp8_sharded``, ``convert.fp8_stored``): ``hf-to-mcore`` of an
FP8 release keeps its e4m3 bytes and block scales as stored, ``mcore-to-hf`` writes them back bit for bit,
``model.ckpt`` + ``model.base_dtype=fp8`` loads them with no dequantize / requantize (and a dense model
dequantized), and ``lora export --merged`` dequantizes, merges and re-quantizes with the release's scheme.

The folder's scales are 4x the canonical ``amax / 448`` (its bytes a quarter): any dequantize-requantize on
the way would change them, so bitwise equality means "as stored"."""

import json

import pytest
import torch

from glm5_mcore.checkpoint.fp8 import quantize_fp8_blocks
from glm5_mcore.checkpoint.fp8_sharded import SCALE_SUFFIX, stored_block
from glm5_mcore.checkpoint.megatron_lm import dcp_metadata
from glm5_mcore.checkpoint.hf_io import HFCheckpoint, dequantize_fp8_blocks
from glm5_mcore.checkpoint.layout import model_dir

from tests.support.helpers import fp8_folders

BLOCK = 16


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    return fp8_folders(tmp_path_factory.mktemp("fp8conv"), block=BLOCK, mtp=True, scale_by=4.0)


@pytest.fixture(scope="module")
def converted(folders, tmp_path_factory):
    from glm5_mcore.convert.hf_to_mcore import hf_to_mcore

    return hf_to_mcore(folders[0], tmp_path_factory.mktemp("fp8mc") / "ckpt", progress=False)


def _stored(folder) -> dict:
    """Every tensor of an HF folder as stored (e4m3 bytes undequantized, scales as their own tensors)."""
    ck = HFCheckpoint(folder)
    out = {}
    for k in ck.keys():
        if not k.endswith(SCALE_SUFFIX):
            t, s = ck.get_stored(k)
            out[k] = t
            if s is not None:
                out[k + SCALE_SUFFIX] = s
    return out


def test_fp8_release_round_trips_bit_for_bit(folders, converted, tmp_path):
    from glm5_mcore.convert.hf_to_mcore import hf_to_mcore
    from glm5_mcore.convert.mcore_to_hf import mcore_to_hf

    fp8, dense = folders
    md = dcp_metadata(model_dir(converted))
    w = "decoder.layers.1.mlp.experts.experts.linear_fc1.weight"  # 8 experts x [gate; up] on a prepended axis
    assert md[w].properties.dtype == torch.float8_e4m3fn and tuple(md[w].size) == (8, 64, 64)
    assert md[w + SCALE_SUFFIX].properties.dtype == torch.float32 and tuple(md[w + SCALE_SUFFIX].size) == (8, 4, 4)
    kv = "decoder.layers.0.self_attention.linear_kv_down_proj.weight"  # 24 rows: one partial block
    assert md[kv].properties.dtype == torch.float8_e4m3fn and tuple(md[kv + SCALE_SUFFIX].size) == (2, 4)
    assert md["embedding.word_embeddings.weight"].properties.dtype == torch.float32  # not a quantized linear
    src = _stored(fp8)
    assert sum(k.endswith(SCALE_SUFFIX) for k in md) == 53 and sum(k.endswith(SCALE_SUFFIX) for k in src) > 53
    assert stored_block(model_dir(converted)) == BLOCK  # the common state's fp8_base_block
    qc = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    assert json.loads((converted / "hf" / "config.json").read_text())["quantization_config"] == qc

    back = mcore_to_hf(converted, tmp_path / "back", max_shard_size="200KB", progress=False)
    got = _stored(back)
    assert sorted(got) == sorted(src)
    for k, t in src.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k].view(torch.uint8), t.view(torch.uint8)), k
    assert json.loads((back / "config.json").read_text())["quantization_config"] == qc

    # a dense folder converts as before (no FP8 in the checkpoint); --dequantize-fp8 makes an FP8 one dense and
    # keeps its quantization_config (the block size model.base_dtype=fp8 quantizes it in again)
    for folder, kw in ((dense, {}), (fp8, {"dequantize_fp8": True})):
        ck = hf_to_mcore(folder, tmp_path / f"dense{len(kw)}", progress=False, **kw)
        md = dcp_metadata(model_dir(ck))
        assert not any(k.endswith(SCALE_SUFFIX) for k in md) and md[w].properties.dtype == torch.float32
        assert json.loads((ck / "hf" / "config.json").read_text()).get("quantization_config") == (qc if kw else None)


def test_fp8_checkpoint_loads_as_stored_and_dequantized(folders, converted, single_rank):
    from glm5_mcore.model.build import build_model, forward_logits
    from glm5_mcore.model.fp8_linear import BlockFP8Weight
    from glm5_mcore.training.model_source import resolve_model
    from glm5_mcore.training.schema import ModelCfg

    from tests.support.helpers import hf_model

    fp8, dense = folders
    ref8, glm5 = hf_model(fp8, base_fp8_block=BLOCK)  # load_hf_weights: the folder's bytes as stored
    ref32, _ = hf_model(dense)
    models = {}
    for base in ("fp8", None):
        source = resolve_model(ModelCfg(ckpt=str(converted), base_dtype=base), lora_enabled=True)
        assert source.base_fp8_block == (BLOCK if base else None)
        models[base] = build_model(source.glm5, base_fp8_block=source.base_fp8_block)
        source.load_weights(models[base])
    got8, ref8p = dict(models["fp8"].named_parameters()), dict(ref8.named_parameters())
    fp8_names = [n for n, p in ref8p.items() if isinstance(p, BlockFP8Weight)]
    assert len(fp8_names) == 109 and fp8_names == [n for n, p in got8.items() if isinstance(p, BlockFP8Weight)]
    for n in fp8_names:  # the stored bytes and scales, not a requantization of their values
        assert torch.equal(got8[n].data_fp8.view(torch.uint8), ref8p[n].data_fp8.view(torch.uint8)), n
        assert torch.equal(got8[n].scale_inv, ref8p[n].scale_inv), n
    for n, p in ref32.named_parameters():  # a dense model: the stored values dequantized per block, exactly
        assert torch.equal(dict(models[None].named_parameters())[n], p), n
    ids = torch.randint(0, glm5.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b = forward_logits(models["fp8"].eval(), ids), forward_logits(models[None].eval(), ids)
    assert (a - b).abs().max() <= 1e-6


def test_a_dense_checkpoint_into_an_fp8_base_is_refused_as_the_hf_folder_is(folders, tmp_path, single_rank):
    """A dense checkpoint whose FP8 block (128: its folder declares none) cuts the routed experts' [gate; up]
    (32 gate rows) is refused when ``model.base_dtype=fp8`` quantizes it, in the very words the HF path
    (``model.hf_dir``) refuses the same folder with; rank-by-rank quantization used to take it (a base no release
    scheme gives)."""
    from glm5_mcore.convert.hf_to_mcore import hf_to_mcore
    from glm5_mcore.model.build import build_model
    from glm5_mcore.training.model_source import resolve_model
    from glm5_mcore.training.schema import ModelCfg

    from tests.support.helpers import hf_model

    _, dense = folders
    with pytest.raises(ValueError) as hf_path:
        hf_model(dense, base_fp8_block=128)
    ck = hf_to_mcore(dense, tmp_path / "ck", progress=False)
    source = resolve_model(ModelCfg(ckpt=str(ck), base_dtype="fp8"), lora_enabled=True)
    assert source.base_fp8_block == 128
    with pytest.raises(ValueError) as ckpt_path:
        source.load_weights(build_model(source.glm5, base_fp8_block=source.base_fp8_block))
    errors = [str(hf_path.value), str(ckpt_path.value)]
    assert "the gate half has 32 rows, not a multiple of the 128-row FP8 block" in errors[0], errors
    assert errors[1] == errors[0], errors


def _fp8_step(q: torch.Tensor, s: torch.Tensor, block: int) -> torch.Tensor:
    """Half the e4m3 spacing at each stored value, times its block's scale: the rounding a quantization may make."""
    qa = q.float().abs().clamp(min=2.0 ** -6)  # subnormals: the spacing of the smallest normal binade
    half = 2.0 ** (torch.floor(torch.log2(qa)) - 4)  # 3 mantissa bits: spacing 2^(e-3), half of it 2^(e-4)
    s_full = s.repeat_interleave(block, 0)[: q.shape[0]].repeat_interleave(block, 1)[:, : q.shape[1]]
    return half * s_full


@pytest.fixture(scope="module")
def lora_runs(folders, converted, tmp_path_factory):
    """LoRA SFT on the FP8 checkpoint (``model.ckpt`` + ``model.base_dtype=fp8``): 3 steps straight; 2 steps
    saved, then resumed to 3. A high learning rate makes adapters large against the FP8 step."""
    from recipes.sft import run

    from tests.support.sft_setup import sft_cfg

    root = tmp_path_factory.mktemp("fp8runs")
    out = {}
    for name, steps in (("straight", [3]), ("resumed", [2, 3])):
        for n in steps:
            cfg = sft_cfg(str(folders[0]), root / name, model={"ckpt": str(converted), "base_dtype": "fp8"},
                          lora={"enabled": True, "rank": 4, "alpha": 16}, optim={"lr": 0.05, "decay_style": "constant"},
                          train={"steps": n, "save_every": 2, "eval_every": 0, "out": str(root / name / "run")})
            out.setdefault(name, []).extend(h["loss"] for h in run(cfg)["history"])
    return root, out


def test_lora_run_on_an_fp8_checkpoint_resumes(lora_runs):
    _, losses = lora_runs
    assert len(losses["straight"]) == 3 and losses["resumed"] == losses["straight"], losses


def test_merged_export_on_fp8_requantizes_the_merged_weight(lora_runs, folders, tmp_path):
    from glm5_mcore.convert.lora_export import export_checkpoint_adapter

    root, _ = lora_runs
    fp8, dense = folders
    run = root / "straight" / "run"
    out8 = export_checkpoint_adapter(run, tmp_path / "m8", merged=True, progress=False)  # base: its FP8 checkpoint
    out8b = export_checkpoint_adapter(run, tmp_path / "m8b", merged=True, progress=False, base=fp8)  # the FP8 folder
    ref = export_checkpoint_adapter(run, tmp_path / "m32", merged=True, progress=False, base=dense,
                                    allow_other_base=True)  # the fp32 base of the same values: other bytes
    got, again, want, base = _stored(out8), _stored(out8b), _stored(ref), _stored(fp8)
    assert sorted(got) == sorted(base) == sorted(again)
    assert json.loads((out8 / "config.json").read_text())["quantization_config"]["weight_block_size"] == [BLOCK] * 2
    n_q, late_fails = 0, 0
    for k in base:
        if k.endswith(SCALE_SUFFIX):
            continue
        assert torch.equal(got[k].view(torch.uint8), again[k].view(torch.uint8)), k
        if k + SCALE_SUFFIX not in base:  # kept dense: the fp32 export's values
            assert torch.equal(got[k], want[k]), k
            continue
        q, s, w = got[k], got[k + SCALE_SUFFIX], want[k]
        qb, sb = base[k], base[k + SCALE_SUFFIX]
        if torch.equal(w, dequantize_fp8_blocks(qb, sb, BLOCK)):  # no adapter on it: the stored bytes, as they were
            assert torch.equal(q.view(torch.uint8), qb.view(torch.uint8)) and torch.equal(s, sb), k
            continue
        n_q += 1
        # the merged fp32 weight quantized with the release's scheme, and within one rounding of it
        q_ref, s_ref = quantize_fp8_blocks(w, BLOCK)
        assert torch.equal(s, s_ref) and torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), k
        err = (dequantize_fp8_blocks(q, s, BLOCK) - w).abs()
        assert bool((err <= _fp8_step(q, s, BLOCK) * (1 + 1e-6)).all()), (k, float(err.max()))
        # a late merge (the adapter added onto FP8 values on the base's scales) misses by more than a step
        sb_full = sb.repeat_interleave(BLOCK, 0)[: w.shape[0]].repeat_interleave(BLOCK, 1)[:, : w.shape[1]]
        late = (w / sb_full).clamp(-448, 448).to(torch.float8_e4m3fn).float() * sb_full
        late_fails += bool(((late - w).abs() > _fp8_step(q, s, BLOCK) * (1 + 1e-6)).any())
        assert not torch.equal(q.view(torch.uint8), qb.view(torch.uint8)), k  # merged, not the base's bytes
    assert n_q >= 30 and late_fails == n_q, (n_q, late_fails)


def _folder_with(fp8, sd: dict, out):
    """A copy of the FP8 folder ``fp8`` (config, tokenizer) whose weights are ``sd``."""
    import shutil

    from safetensors.torch import save_file

    out.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(fp8 / f, out / f)
    save_file(sd, str(out / "model.safetensors"))
    return out


def test_bad_fp8_scales_are_named_before_anything_is_written(folders, tmp_path):
    from glm5_mcore.convert.hf_to_mcore import hf_to_mcore

    fp8, _ = folders
    sd = _stored(fp8)
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    sd[name] = sd[name][:-1].contiguous()  # a row of blocks short
    bad = _folder_with(fp8, sd, tmp_path / "bad")
    with pytest.raises(ValueError, match=rf"model.safetensors: tensor {name} has shape \[3, 4\], which does not tile"):
        hf_to_mcore(bad, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_a_missing_block_scale_is_one_line_before_anything_is_written(folders, tmp_path, capfd):
    """``glm5 convert hf-to-mcore`` of a folder missing one ``weight_scale_inv``: the console's one line naming the
    file and tensor, exit 2, no output folder; the scale was found missing in the DCP writer's thread, after two
    tracebacks of it."""
    from recipes.main import main

    fp8, _ = folders
    sd = _stored(fp8)
    del sd["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    bad = _folder_with(fp8, sd, tmp_path / "bad")
    capfd.readouterr()
    rc = main(["convert", "hf-to-mcore", "--hf-dir", str(bad), "--out", str(tmp_path / "out"), "--no-progress"])
    err = capfd.readouterr().err
    print(err)
    lines = [ln for ln in err.splitlines() if ln.startswith("glm5 convert: error:")]
    assert rc == 2 and lines == [f"glm5 convert: error: {bad / 'model.safetensors'}: FP8 tensor model.layers.1.self_attn."
                                 "o_proj.weight has no model.layers.1.self_attn.o_proj.weight_scale_inv block scale"]
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_megatron_export_of_an_fp8_checkpoint_is_refused(converted, tmp_path):
    from glm5_mcore.convert.megatron_export import export_megatron

    with pytest.raises(ValueError, match=r"stores the frozen base in FP8 .* --dequantize-fp8"):
        export_megatron(converted, tmp_path / "meg")
    assert not (tmp_path / "meg").exists()

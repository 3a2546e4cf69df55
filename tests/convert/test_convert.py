"""The checkpoint bridge: HF <-> Megatron-Core checkpoints, lossless, any TP/EP, MTP included."""

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from glm5_mcore.config import GLM5Config
from glm5_mcore.checkpoint.hf_io import HFCheckpoint, dequantize_fp8_blocks

from tests.support.launch import glm5, last_json, torchrun



def _all_tensors(hf_dir) -> dict:
    ck = HFCheckpoint(hf_dir)
    return {k: ck.get(k) for k in ck.keys()}


def _write_hf(src_dir, out, tensors, config_edit=None, shards=1):
    """A copy of ``src_dir`` with ``tensors`` as weights (split over ``shards`` files + index)."""
    out = Path(out)
    out.mkdir(parents=True)
    cfg = json.loads((Path(src_dir) / "config.json").read_text())
    if config_edit:
        cfg.update(config_edit)
    (out / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(src_dir) / f, out / f)
    names = list(tensors)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({k: tensors[k].contiguous() for k in part}, str(out / fname))
        weight_map.update({k: fname for k in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return out


def _tree_hash(d) -> dict:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(d).rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def tiny_both_dir(tmp_path_factory):
    from glm5_mcore.tiny import write_tiny

    return str(write_tiny(tmp_path_factory.mktemp("ckpt") / "tiny_both", mtp=True, index_share=True, seed=3))


@pytest.fixture(scope="module")
def converted(tiny_both_dir, tmp_path_factory):
    from glm5_mcore.convert.hf_to_mcore import hf_to_mcore

    return hf_to_mcore(tiny_both_dir, tmp_path_factory.mktemp("mc") / "ckpt", progress=False)


# --------------------------------------------------------------------------------------------------
# lossless round trips
# --------------------------------------------------------------------------------------------------
def _round_trip_equal(src_dir, tmp_path, reference=None, **kw):
    from glm5_mcore.convert.hf_to_mcore import hf_to_mcore
    from glm5_mcore.convert.mcore_to_hf import mcore_to_hf

    ck = hf_to_mcore(src_dir, tmp_path / "mc", progress=False, **kw)
    back = mcore_to_hf(ck, tmp_path / "hf", max_shard_size="200KB", progress=False)
    a, b = reference or _all_tensors(src_dir), _all_tensors(back)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    return back


def test_round_trip_is_bit_exact_with_mtp_and_index_share(tiny_both_dir, tmp_path):
    cfg = GLM5Config.from_hf_dir(tiny_both_dir)
    back = _round_trip_equal(tiny_both_dir, tmp_path)
    names = HFCheckpoint(back).keys()
    L = cfg.num_hidden_layers
    assert f"model.layers.{L}.eh_proj.weight" in names and f"model.layers.{L}.mlp.experts.7.up_proj.weight" in names
    assert not any(n.startswith("model.layers.2.self_attn.indexer") for n in names)  # IndexShare layer
    assert len(list(Path(back).glob("model-*-of-*.safetensors"))) > 1
    assert json.loads((Path(back) / "config.json").read_text())["num_nextn_predict_layers"] == 1
    from megatron.core.transformer.multi_token_prediction import MTPLossAutoScaler

    assert MTPLossAutoScaler.main_loss_backward_scale.device.type == "cpu"  # meta build leaked nothing


def test_round_trip_bf16_keeps_router_fp32(tiny_dir, tmp_path):
    src = _all_tensors(tiny_dir)
    bf = {k: (v if k.endswith(("mlp.gate.weight", "e_score_correction_bias")) else v.bfloat16())
          for k, v in src.items()}
    d = _write_hf(tiny_dir, tmp_path / "bf16", bf, {"dtype": "bfloat16"}, shards=3)
    back = _round_trip_equal(d, tmp_path, reference=bf)
    got = HFCheckpoint(back)
    assert got.get("model.layers.1.mlp.gate.weight").dtype == torch.float32
    assert got.get("model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32
    assert got.get("model.layers.1.self_attn.q_b_proj.weight").dtype == torch.bfloat16


def test_fused_expert_layout_imports_as_per_expert(tiny_dir, tmp_path):
    from glm5_mcore.tiny import fuse_experts

    src = _all_tensors(tiny_dir)
    d = _write_hf(tiny_dir, tmp_path / "fused", fuse_experts(src))
    assert "model.layers.1.mlp.experts.gate_up_proj" in HFCheckpoint(d).keys()
    _round_trip_equal(d, tmp_path, reference=src)


# --------------------------------------------------------------------------------------------------
# the converted checkpoint is the right function (not just a symmetric mapping)
# --------------------------------------------------------------------------------------------------
def test_converted_checkpoint_matches_transformers_tp1(converted, tiny_both_dir):
    from glm5_mcore.mcore_settings import ParallelConfig
    from glm5_mcore.parity import load_input_ids, run_parity

    ids = load_input_ids(None, 128, 2, 32, seed=5)
    rep = run_parity(tiny_both_dir, ids, ParallelConfig(), ckpt=str(converted))
    assert rep["max_abs"] <= 1e-4 and rep["topk_agree"] == 1.0 and rep["router_agree"] == 1.0, rep


@pytest.mark.slow
def test_converted_checkpoint_matches_transformers_tp2_ep2(converted):
    rep = last_json(glm5("parity", "--ckpt", converted, "--tp", "2", "--ep", "2", nproc=2).stdout)
    assert rep["tp"] == 2 and rep["ep"] == 2 and rep["max_abs"] <= 1e-4 and rep["topk_agree"] == 1.0, rep


@pytest.mark.slow
def test_saved_at_tp2_ep2_loads_at_tp1(tiny_both_dir, tmp_path, single_rank):
    from glm5_mcore.checkpoint.layout import latest_iteration, model_dir
    from glm5_mcore.checkpoint.dist import load_model
    from glm5_mcore.model.build import build_model, forward_logits
    from glm5_mcore.checkpoint.hf_load import load_hf_weights

    out = tmp_path / "run"
    torchrun("bridge_check.py", tiny_both_dir, 2, 2, out)
    assert latest_iteration(out) == 3 and (out / "iter_0000003" / "trainer_state.json").is_file()
    glm5 = GLM5Config.from_hf_dir(out / "hf")
    ids = torch.randint(0, glm5.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1))
    ref = build_model(glm5)
    load_hf_weights(ref, tiny_both_dir, glm5)
    got = build_model(glm5)
    load_model(got, model_dir(out))
    with torch.no_grad():
        a, b = forward_logits(ref.eval(), ids), forward_logits(got.eval(), ids)
    assert torch.equal(a, b), float((a - b).abs().max())
    # the same TP2/EP2-chunked checkpoint (Megatron's own save: largest items first) exported to HF
    from glm5_mcore.convert.mcore_to_hf import mcore_to_hf
    from glm5_mcore.checkpoint.hf_io import HFCheckpoint

    src, back = HFCheckpoint(tiny_both_dir), HFCheckpoint(mcore_to_hf(out, tmp_path / "hf_back", progress=False))
    assert sorted(src.keys()) == sorted(back.keys())
    for name in src.keys():
        assert torch.equal(src.get(name), back.get(name)), name


def test_odd_vocabulary_round_trips_and_its_padded_save_exports_the_real_rows(tiny_odd_dir, tmp_path, single_rank):
    """A vocabulary of 129: HF -> mcore -> HF is bit-exact; a model padded to 256 rows (Megatron-LM's
    make_vocab_size_divisible_by=128) loads it with zero rows added and saves the padded rows (what
    Megatron-Core's save writes: ``model.vocab``), that checkpoint loads unpadded again, and mcore-to-hf
    writes the real 129 rows only, every tensor equal to the HF origin."""
    from torch.distributed.checkpoint import FileSystemReader

    from glm5_mcore.checkpoint.dist import load_model
    from glm5_mcore.checkpoint.layout import model_dir, write_hf_meta
    from glm5_mcore.convert.mcore_to_hf import mcore_to_hf
    from glm5_mcore.mcore_settings import ParallelConfig
    from glm5_mcore.model.build import build_model, forward_logits
    from glm5_mcore.training.checkpointing import save_checkpoint

    ck = tmp_path / "rt"
    _round_trip_equal(tiny_odd_dir, ck)
    glm5 = GLM5Config.from_hf_dir(tiny_odd_dir)
    padded = build_model(glm5, ParallelConfig(make_vocab_size_divisible_by=128))
    load_model(padded, model_dir(ck / "mc"))  # stored: 129 rows; the model: 256
    emb = padded.embedding.word_embeddings.weight
    assert emb.shape[0] == 256 and emb[129:].abs().max() == 0
    save_checkpoint(tmp_path / "run", 1, padded, {"iteration": 1})
    write_hf_meta(tmp_path / "run" / "hf", tiny_odd_dir)
    stored = FileSystemReader(str(model_dir(tmp_path / "run"))).read_metadata().state_dict_metadata
    assert stored["embedding.word_embeddings.weight"].size[0] == 256 == stored["output_layer.weight"].size[0]
    plain = build_model(glm5)
    load_model(plain, model_dir(tmp_path / "run"))  # stored: 256 rows; the model: 129
    ids = torch.randint(0, 129, (2, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        a, b = forward_logits(padded.eval(), ids), forward_logits(plain.eval(), ids)
    assert a.shape == b.shape == (2, 32, 129) and torch.equal(a, b), float((a - b).abs().max())
    src, back = _all_tensors(tiny_odd_dir), _all_tensors(mcore_to_hf(tmp_path / "run", tmp_path / "back",
                                                                     progress=False))
    assert sorted(src) == sorted(back) and back["lm_head.weight"].shape == (129, 64)
    for k in src:
        assert src[k].dtype == back[k].dtype and torch.equal(src[k], back[k]), k


# --------------------------------------------------------------------------------------------------
# FP8 block-scaled import
# --------------------------------------------------------------------------------------------------
def _reference_dequant(w, s, b=128):
    out = torch.empty(w.shape, dtype=torch.float32)
    for i in range(0, w.shape[0], b):
        for j in range(0, w.shape[1], b):
            out[i:i + b, j:j + b] = w[i:i + b, j:j + b].float() * s[i // b, j // b].float()
    return out


def _quantize_fp8(w, b=128):
    M, N = w.shape
    s = torch.empty((M + b - 1) // b, (N + b - 1) // b)
    q = torch.empty(M, N, dtype=torch.float8_e4m3fn)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * b:(i + 1) * b, j * b:(j + 1) * b]
            s[i, j] = blk.abs().max().clamp(min=1e-12) / 448.0
            q[i * b:(i + 1) * b, j * b:(j + 1) * b] = (blk / s[i, j]).to(torch.float8_e4m3fn)
    return q, s


def test_fp8_dequant_partial_blocks():
    w = torch.randn(576, 300)
    q, s = _quantize_fp8(w)
    assert s.shape == (5, 3)  # 576 = 4.5 blocks, 300 = 2.3 blocks
    assert torch.equal(dequantize_fp8_blocks(q, s), _reference_dequant(q, s))
    assert (dequantize_fp8_blocks(q, s) - w).abs().max() < 0.1 * w.abs().max()
    with pytest.raises(ValueError, match="does not tile"):
        dequantize_fp8_blocks(q, s[:4])


def test_fp8_checkpoint_imports_dequantized(tiny_dir, tmp_path, single_rank):
    from glm5_mcore.checkpoint.dist import load_model
    from glm5_mcore.checkpoint.layout import model_dir
    from glm5_mcore.convert.hf_to_mcore import hf_to_mcore
    from glm5_mcore.model.build import build_model

    src = _all_tensors(tiny_dir)
    fp8, expect = {}, {}
    for k, v in src.items():
        quantize = v.dim() == 2 and k.endswith("proj.weight") and "embed" not in k
        if quantize:
            q, s = _quantize_fp8(v)
            fp8[k], fp8[k + "_scale_inv"] = q, s
            expect[k] = _reference_dequant(q, s)
        else:
            fp8[k] = expect[k] = v
    d = _write_hf(tiny_dir, tmp_path / "fp8", fp8, {"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}})
    ck = hf_to_mcore(d, tmp_path / "mc", dtype="fp32", progress=False, dequantize_fp8=True)  # kept: test_fp8_convert
    # the origin's quantization_config kept (its block size: model.base_dtype=fp8 quantizes the base again in it)
    assert json.loads((ck / "hf" / "config.json").read_text())["quantization_config"]["weight_block_size"] == [128, 128]
    glm5 = GLM5Config.from_hf_dir(ck / "hf")
    model = build_model(glm5)
    load_model(model, model_dir(ck))
    sd = model.state_dict()
    q_b = sd["decoder.layers.1.self_attention.linear_q_up_proj.weight"]
    assert torch.equal(q_b, expect["model.layers.1.self_attn.q_b_proj.weight"])
    kv_a = sd["decoder.layers.0.self_attention.linear_kv_down_proj.weight"]  # 24 rows: one partial block
    assert torch.equal(kv_a, expect["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"])
    fc1 = sd["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"]
    assert torch.equal(fc1, torch.cat([expect["model.layers.1.mlp.experts.3.gate_proj.weight"],
                                       expect["model.layers.1.mlp.experts.3.up_proj.weight"]]))


# --------------------------------------------------------------------------------------------------
# bad input: a clear error naming the file / tensor, and the previous output untouched
# --------------------------------------------------------------------------------------------------
def _corrupt_cases(tiny_dir, tmp_path):
    src = _all_tensors(tiny_dir)

    def missing_shard():
        d = _write_hf(tiny_dir, tmp_path / "missing", src, shards=2)
        (d / "model-00002-of-00002.safetensors").unlink()
        return d, "model-00002-of-00002.safetensors"

    def truncated():
        d = _write_hf(tiny_dir, tmp_path / "trunc", src)
        f = d / "model-00001-of-00001.safetensors"
        f.write_bytes(f.read_bytes()[:-100])
        return d, "truncated"

    def corrupt_header():
        d = _write_hf(tiny_dir, tmp_path / "corrupt", src)
        f = d / "model-00001-of-00001.safetensors"
        raw = bytearray(f.read_bytes())
        raw[8:40] = b"\xff" * 32
        f.write_bytes(bytes(raw))
        return d, "corrupt safetensors header"

    def wrong_shape():
        bad = dict(src)
        bad["model.layers.1.self_attn.o_proj.weight"] = torch.zeros(64, 60)
        return _write_hf(tiny_dir, tmp_path / "shape", bad), "model.layers.1.self_attn.o_proj.weight has shape"

    def wrong_dtype():
        bad = dict(src)
        bad["model.layers.0.input_layernorm.weight"] = torch.ones(64, dtype=torch.int32)
        return _write_hf(tiny_dir, tmp_path / "dtype", bad), "model.layers.0.input_layernorm.weight has dtype"

    def unmapped():
        bad = dict(src)
        bad["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
        return _write_hf(tiny_dir, tmp_path / "unmapped", bad), "rotary_emb.inv_freq"

    def expert_count():
        d = _write_hf(tiny_dir, tmp_path / "experts", src, {"n_routed_experts": 16})
        return d, "model.layers.1.mlp.gate.weight has shape [8, 64], the config implies [16, 64]"

    def fewer_experts_in_config():
        d = _write_hf(tiny_dir, tmp_path / "experts4", src, {"n_routed_experts": 4})
        return d, "the config implies [4, 64]"

    return [missing_shard, truncated, corrupt_header, wrong_shape, wrong_dtype, unmapped, expert_count,
            fewer_experts_in_config]


def test_bad_hf_input_is_named_and_previous_output_survives(tiny_dir, tmp_path):
    from glm5_mcore.convert.hf_to_mcore import hf_to_mcore

    out = tmp_path / "out"
    hf_to_mcore(tiny_dir, out, progress=False)
    before = _tree_hash(out)
    for case in _corrupt_cases(tiny_dir, tmp_path):
        d, needle = case()
        with pytest.raises((ValueError, FileNotFoundError, KeyError)) as e:
            hf_to_mcore(d, out, progress=False)
        assert needle in str(e.value), (case.__name__, str(e.value))
        assert _tree_hash(out) == before, case.__name__
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".out")) == []


def test_bad_mcore_input_is_named_and_previous_output_survives(converted, tmp_path):
    from glm5_mcore.convert.mcore_to_hf import mcore_to_hf

    out = mcore_to_hf(converted, tmp_path / "hf", progress=False)
    before = _tree_hash(out)
    broken = tmp_path / "broken"
    shutil.copytree(converted, broken)
    data = next((broken / "iter_0000000" / "model").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    with pytest.raises(ValueError, match=f"{data.name}: .* bytes, the manifest says"):
        mcore_to_hf(broken, out, progress=False)
    (broken / "iter_0000000" / "manifest.json").unlink()  # unverified: the load itself names the folder
    with pytest.raises(ValueError, match="iter_0000000/model: could not load") as e:
        mcore_to_hf(broken, out, progress=False)
    assert "Traceback" not in str(e.value) and "\n" not in str(e.value)
    (broken / "latest").write_text("7\n")
    with pytest.raises(FileNotFoundError, match="iter_0000007: named by .*latest but missing"):
        mcore_to_hf(broken, out, progress=False)
    assert _tree_hash(out) == before


@pytest.mark.slow
def test_cli_convert_round_trip_and_errors(tiny_dir, tmp_path):
    glm5("convert", "hf-to-mcore", "--hf-dir", tiny_dir, "--out", tmp_path / "mc", "--workers", "2", "--no-progress")
    glm5("convert", "mcore-to-hf", "--ckpt", tmp_path / "mc", "--out", tmp_path / "hf", "--no-progress")
    a, b = _all_tensors(tiny_dir), _all_tensors(tmp_path / "hf")
    assert all(torch.equal(a[k], b[k]) for k in a) and sorted(a) == sorted(b)
    r = glm5("convert", "mcore-to-hf", "--ckpt", tmp_path / "nope", "--out", tmp_path / "hf2", ok=False)
    assert r.returncode == 2 and "nope/latest" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "hf2").exists()

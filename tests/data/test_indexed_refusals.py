"""Indexed data that does not belong together is refused with one line naming the file (issue 34, classes 7
and 14): a ``.bin`` of another size than its ``.idx`` says, half a loss-mask stream, a loss mask the
preprocess summary records but that is gone, data tokenized by another tokenizer of the same vocabulary
size, token ids beyond the model's vocabulary, an odd-length ``data.blend``, changed blend weights at a
resume, and ``glm5 data preprocess`` without its tokenizer folder. Nothing is written by a refused run."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from glm5_mcore.data.preprocess import preprocess
from recipes.main import main as glm5


def _rows(path, n, seed):
    import random

    r = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            a = [r.randrange(90) for _ in range(r.randrange(3, 10))]
            f.write(json.dumps({"prompt": " ".join(f"w{x}" for x in a),
                                "response": " ".join(f"w{a[0] + k}" for k in range(4))}) + "\n")
    return path


@pytest.fixture(scope="module")
def idx(tmp_path_factory, tiny_dir):
    """Two preprocessed datasets of the tiny tokenizer: ``a`` (12 rows) and ``b`` (40 rows), loss masks on."""
    root = tmp_path_factory.mktemp("idx")
    for name, n in (("a", 12), ("b", 40)):
        preprocess([_rows(root / f"{name}.jsonl", n, n)], root / name, tiny_dir, progress=False)
    return root


def _cfg(tiny_dir, out, **data):
    from recipes.sft import SFTConfig

    return SFTConfig.from_dict({
        "model": {"hf_dir": tiny_dir},
        "data": {"micro_batch_tokens": 128, "global_batch_tokens": 128, "max_tokens": 64, **data},
        "optim": {"lr": 1e-3, "decay_style": "constant"}, "lora": {"enabled": True, "rank": 4},
        "train": {"steps": 2, "out": str(out), "progress": False}, "wandb": {"mode": "disabled"}})


def _validate(tiny_dir, tmp_path, **data):
    from glm5_mcore.config import GLM5Config
    from recipes.sft import validate

    validate(_cfg(tiny_dir, tmp_path / "out", **data), GLM5Config.from_hf_dir(tiny_dir), 1)


def _copy(idx, tmp_path, name="a") -> Path:
    return Path(shutil.copytree(idx / name, tmp_path / name))


def test_a_bin_of_another_size_than_its_idx_is_refused(idx, tiny_dir, tmp_path):
    """Class 7 (a larger .bin, from another dataset: trained on the wrong bytes) and 14 (a smaller one:
    ``__len__() should return >= 0``)."""
    d = _copy(idx, tmp_path)
    shutil.copy(idx / "b" / "tokens.bin", d / "tokens.bin")
    with pytest.raises(ValueError, match=r"a/tokens\.bin: \d+ bytes, but .*a/tokens\.idx indexes \d+ .*another"):
        _validate(tiny_dir, tmp_path, train=str(d))
    raw = (idx / "a" / "tokens.bin").read_bytes()
    (d / "tokens.bin").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match=r"a/tokens\.bin: \d+ bytes, .*\(cut short"):
        _validate(tiny_dir, tmp_path, train=str(d))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("gone", ["loss_mask.idx", "loss_mask.bin", "both"])
def test_a_missing_loss_mask_file_is_refused(idx, tiny_dir, tmp_path, gone):
    """Class 7 (no loss_mask.idx: the prompt tokens were trained silently) and 14 (no loss_mask.bin: a raw
    AssertionError); with both gone, the preprocess summary still says there was a mask."""
    d = _copy(idx, tmp_path)
    for f in (["loss_mask.idx", "loss_mask.bin"] if gone == "both" else [gone]):
        (d / f).unlink()
    want = "loss_mask.idx: missing" if gone != "loss_mask.bin" else "loss_mask.bin: missing beside"
    with pytest.raises(FileNotFoundError, match=want):
        _validate(tiny_dir, tmp_path, train=str(d))


def test_data_of_another_tokenizer_with_the_same_vocab_size_is_refused(idx, tiny_dir, tmp_path):
    """Class 7: the tokenizer's identity (summary.json tokenizer_id) is recorded at preprocess time and checked."""
    from recipes.sft import run

    other = Path(shutil.copytree(tiny_dir, tmp_path / "other_tok"))
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    words = sorted(w for w in vocab if w.startswith("w"))
    ids = [vocab[w] for w in words]
    for w, i in zip(words, reversed(ids)):  # the same size, other ids
        vocab[w] = i
    (other / "tokenizer.json").write_text(json.dumps(tok))
    preprocess([idx / "a.jsonl"], tmp_path / "a_other", other, progress=False)
    assert json.loads((tmp_path / "a_other" / "summary.json").read_text())["vocab_size"] == len(vocab)
    with pytest.raises(ValueError, match=r"a_other: tokenized with another tokenizer .* re-run glm5 data preprocess"):
        run(_cfg(tiny_dir, tmp_path / "run", train=str(tmp_path / "a_other")))
    assert not (tmp_path / "run").exists()
    # the same tokenizer in another folder is the same identity
    from glm5_mcore.data.indexed import check_tokenizer
    from glm5_mcore.data.preprocess import load_tokenizer, tokenizer_identity

    same = Path(shutil.copytree(tiny_dir, tmp_path / "same_tok"))
    assert tokenizer_identity(load_tokenizer(same)) == json.loads((idx / "a" / "summary.json").read_text())["tokenizer_id"]
    check_tokenizer(_cfg(tiny_dir, tmp_path / "run", train=str(idx / "a")).data, load_tokenizer(same), str(same))


def test_token_ids_beyond_the_vocabulary_name_the_dataset(tiny_dir, tmp_path):
    """Class 14: a Megatron prefix (another tool's: no summary) with an id past the vocabulary: the
    dataset and document named, not an IndexError in the embedding."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from glm5_mcore.config import GLM5Config
    from recipes.sft import run

    vocab = GLM5Config.from_hf_dir(tiny_dir).vocab_size
    prefix = tmp_path / "web"
    b = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.int32)
    for k in range(12):
        ids = np.arange(5, 30, dtype=np.int32) + k
        if k == 7:
            ids[3] = vocab + 5
        b.add_document(ids, [len(ids)])
    b.finalize(f"{prefix}.idx")
    with pytest.raises(ValueError, match=rf"{prefix}: document 7 holds token id {vocab + 5}, beyond .* {vocab}"):
        run(_cfg(tiny_dir, tmp_path / "run", train=str(prefix), max_tokens=32, micro_batch_tokens=512,
                 global_batch_tokens=512))


@pytest.mark.parametrize("blend,where", [([0.7, "A", 0.3], "3 entries"), ([0.7, "A", "B", 0.3], "entry 3"),
                                          ("0.5 A 0.5", "3 entries")])
def test_an_odd_blend_is_one_line_naming_the_field(idx, tiny_dir, tmp_path, blend, where):
    """Class 14: an odd-length data.blend (a weight without its prefix) names data.blend and the entry."""
    sub = {"A": str(idx / "a"), "B": str(idx / "b")}
    blend = " ".join(sub.get(x, x) for x in blend.split()) if isinstance(blend, str) else [
        sub.get(x, x) for x in blend]
    with pytest.raises(ValueError, match=rf"data\.blend: .*expected weight, prefix pairs .*{where}"):
        _validate(tiny_dir, tmp_path, blend=blend)


def test_changed_blend_weights_at_resume_are_refused(idx, tiny_dir, tmp_path):
    """Class 7: the weights decide which documents each step draws; a resume with others is refused
    like any changed setting (reordered members already were)."""
    from recipes.sft import run

    out = tmp_path / "run"
    run(_cfg(tiny_dir, out, blend=[0.5, str(idx / "a"), 0.5, str(idx / "b")]))
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    cfg = _cfg(tiny_dir, out, blend=[0.9, str(idx / "a"), 0.1, str(idx / "b")])
    cfg.train.steps = 3
    with pytest.raises(ValueError, match=r"data\.blend_weights: \[0\.5, 0\.5\] -> \[0\.9, 0\.1\]"):
        run(cfg)
    assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before


def test_preprocess_without_its_tokenizer_folder_is_one_line(idx, tmp_path, capsys):
    """Class 14: ``--hf-dir`` missing (4 stacked tracebacks before): exit 2, one line, nothing written."""
    out = tmp_path / "out"
    for hf in (tmp_path / "nope", tmp_path):
        code = glm5(["data", "preprocess", "--input", str(idx / "a.jsonl"), "--out", str(out), "--hf-dir", str(hf),
                     "--no-progress"])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(err) == 1 and err[0].startswith(f"glm5 data: error: --hf-dir {hf}: "), err
        assert not out.exists()

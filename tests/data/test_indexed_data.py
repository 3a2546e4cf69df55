"""Indexed data: ``glm5 data preprocess`` → Megatron-Core indexed datasets → ``glm5 sft``.

Preprocessing keeps every token, loss mask and document boundary of the jsonl path; training from
the indexed copy gives the jsonl path's losses; blends draw in their weights' proportions; a run
killed mid-way resumes at exactly the next samples; bad input stops with file:line and harms nothing.
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

from glm5_mcore.data.sft import DataStats, read_jsonl
from glm5_mcore.data.preprocess import preprocess

from tests.support.sft_setup import reverse_task, sft_cfg, tokenizer


from tests.support.launch import child_env, torchrun_cmd


def _mixed_rows(path, n, seed):
    """Every row kind: pretraining text, prompt/response, multi-turn chat (loss on assistant turns)."""
    import random

    r = random.Random(seed)
    words = lambda k: " ".join(f"w{r.randrange(90)}" for _ in range(k))  # noqa: E731
    with open(path, "w") as f:
        for i in range(n):
            kind = i % 3
            if kind == 0:
                row = {"text": words(r.randrange(3, 40))}
            elif kind == 1:
                row = {"prompt": words(r.randrange(2, 9)), "response": words(r.randrange(1, 6))}
            else:
                row = {"messages": [{"role": "user", "content": words(3)}, {"role": "assistant", "content": words(2)},
                                    {"role": "user", "content": words(2)}, {"role": "assistant", "content": words(4)}]}
            f.write(json.dumps(row) + "\n")
    return path


def _read(prefix):
    from glm5_mcore.data.indexed import Corpus

    c = Corpus(prefix)
    return [c.document(i, 10**9) for i in range(len(c))]


def test_preprocess_keeps_tokens_loss_masks_and_documents_of_every_row_kind(tiny_dir, tmp_path):
    src = _mixed_rows(tmp_path / "mixed.jsonl", 90, 0)
    with open(src, "a") as f:  # bad rows, skipped and counted as the recipe does
        f.write('{"prompt": 3}\nnot json\n')
        f.write('{"text": "w1 w2"}\n')
    with open(src, "ab") as f:
        f.write(b'{"text": "w1 \xff"}\n')
    tok = tokenizer(tiny_dir)
    stats = DataStats()
    ref = read_jsonl(_good_copy(src, tmp_path), tok, 24, stats=stats)
    out = preprocess([src], tmp_path / "idx", tiny_dir, workers=2, max_tokens=24, skip_bad_rows=True,
                     chunk_mb=2e-3, progress=False)  # ~4 kB ranges: several per worker
    assert out["documents"] == len(ref) == 91 and out["skipped"] == 3 and out["rows"] == 94
    assert out["truncated"] == stats.truncated > 0 and out["tokens"] == sum(len(d.tokens) for d in ref)
    assert "mixed.jsonl:91: 'prompt' and a non-empty 'response'" in out["errors"][0]
    assert "mixed.jsonl:92: not valid JSON" in out["errors"][1]
    assert "mixed.jsonl:94: not valid UTF-8" in out["errors"][2]
    got = _read(str(tmp_path / "idx" / "tokens"))
    assert [d.tokens for d in got] == [d.tokens for d in ref]
    assert [d.mask for d in got] == [d.mask for d in ref]  # prompt / user tokens carry no loss
    chat = got[2]
    assert 0 < sum(chat.mask) < len(chat.mask) and chat.mask[0] == 0
    one = preprocess([src], tmp_path / "idx1", tiny_dir, workers=1, max_tokens=24, skip_bad_rows=True,
                     progress=False)
    for f in ("tokens.bin", "tokens.idx", "loss_mask.bin", "loss_mask.idx"):
        assert (tmp_path / "idx1" / f).read_bytes() == (tmp_path / "idx" / f).read_bytes(), f
    text_only = tmp_path / "text.jsonl"
    text_only.write_text("".join(json.dumps({"text": f"w{i} w{i + 1} w{i + 2}"}) + "\n" for i in range(5)))
    s = preprocess([text_only], tmp_path / "text_idx", tiny_dir, progress=False)
    assert not s["loss_mask"] and not (tmp_path / "text_idx" / "loss_mask.idx").exists()
    assert all(d.mask == [1] * len(d.tokens) for d in _read(str(tmp_path / "text_idx" / "tokens")))
    assert one["documents"] == out["documents"]


def _good_copy(src, tmp_path):
    """The rows of ``src`` that parse (the reference the skipped rows are compared with)."""
    good = tmp_path / "good.jsonl"
    lines = Path(src).read_bytes().split(b"\n")
    good.write_bytes(b"\n".join(lines[:90] + [lines[92]]) + b"\n")
    return good


def test_preprocess_bad_input_stops_with_file_line_and_harms_nothing(tiny_dir, tmp_path, capsys):
    from recipes.main import main

    src = _mixed_rows(tmp_path / "rows.jsonl", 12, 1)
    out = tmp_path / "out"
    assert main(["data", "preprocess", "--input", str(src), "--out", str(out), "--hf-dir", tiny_dir,
                 "--no-progress"]) == 0
    before = {f.name: f.read_bytes() for f in out.iterdir()}
    bad = tmp_path / "bad.jsonl"
    bad.write_text(src.read_text() + '{"messages": []}\n')
    assert main(["data", "preprocess", "--input", str(bad), "--out", str(out), "--hf-dir", tiny_dir,
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"glm5 data: error: {bad}:13: 'messages' must be a non-empty list" in err, err
    assert {f.name: f.read_bytes() for f in out.iterdir()} == before  # the previous output, untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "out", "rows.jsonl"]  # no temporaries
    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    assert main(["data", "preprocess", "--input", str(src), "--out", str(other), "--hf-dir", tiny_dir,
                 "--no-progress"]) == 2
    assert "is not a glm5 data preprocess output; refusing" in capsys.readouterr().err
    assert (other / "notes.txt").read_text() == "keep"
    assert main(["data", "preprocess", "--input", str(src), "--out", str(tmp_path), "--hf-dir", tiny_dir,
                 "--no-progress"]) == 2
    assert "would contain or replace the input" in capsys.readouterr().err
    assert main(["data", "preprocess", "--input", str(tmp_path / "nope.jsonl"), "--out", str(out), "--hf-dir",
                 tiny_dir, "--no-progress"]) == 2
    assert "nope.jsonl: input file does not exist" in capsys.readouterr().err


def _data_cfg(**kw):
    from recipes.sft import DataCfg

    d = DataCfg(micro_batch_tokens=64, global_batch_tokens=256, max_tokens=32, seed=7)
    for k, v in kw.items():
        setattr(d, k, v)
    return d


def test_blend_draws_in_weight_proportions_dp_ranks_read_only_their_share(tiny_dir, tmp_path):
    from glm5_mcore.data.indexed import Corpus, IndexedData

    for name, seed in (("web", 0), ("code", 1), ("math", 2)):
        preprocess([_mixed_rows(tmp_path / f"{name}.jsonl", 60 + 30 * seed, seed)], tmp_path / name, tiny_dir,
                   progress=False)
    blend = [0.5, str(tmp_path / "web"), 0.3, str(tmp_path / "code"), 0.2, str(tmp_path / "math")]
    data = IndexedData(_data_cfg(blend=blend, split="90,10,0"), 50, 4, 1, 0, 1, 0, str(tmp_path / "cache"))
    groups, _, nxt = data.train.plan(0, 200, 64)  # 200 micro-batches, several epochs of each member
    src = data.train.sources(0, nxt)
    assert nxt > 400  # web: 54 train documents, drawn ~6 times each
    for k in range(1, nxt + 1, 37):  # every prefix of the stream: within one document of the weights
        counts = np.bincount(src[:k], minlength=3)
        assert np.abs(counts - k * np.array([0.5, 0.3, 0.2])).max() <= 1.0, (k, counts)
    drawn = [data.train.document(i).source.rsplit("#", 1) for i in range(nxt)]
    train_docs = {(p, int(d)) for p, d in drawn}
    web = str(tmp_path / "web" / "tokens")
    assert {d for p, d in train_docs if p == web} == set(range(54))  # 90 % of 60, every one drawn
    valid = [d for b in data.valid_batches() for d in b.sources]
    # validation: the 10 % split of each member, blended by the weights as Megatron does (27 documents
    # -> ceil(27 w) draws each), never a training document
    first_valid = {"web": 54, "code": 81, "math": 108}
    per = {k: [int(s.rsplit("#", 1)[1]) for s in valid if s.startswith(str(tmp_path / k))] for k in first_valid}
    assert [len(v) for v in per.values()] == [14, 9, 6]
    assert all(min(v) >= first_valid[k] for k, v in per.items())
    # the same stream, split over DP=2: each rank gets its half of every step and reads nothing else
    reads = {0: [], 1: []}
    orig = Corpus.document
    for rank in (0, 1):
        Corpus.document = lambda self, doc, m, r=rank: reads[r].append((self.prefix, doc)) or orig(self, doc, m)
        try:
            dp = IndexedData(_data_cfg(blend=blend, split="90,10,0"), 50, 2, 2, rank, 1, 0, str(tmp_path / "cache"))
            mine, tokens, nxt2 = dp.step(0)
        finally:
            Corpus.document = orig
        one, one_tokens, nxt1 = data.step(0)
        assert nxt2 == nxt1 and tokens == one_tokens
        assert [b.sources for b in mine] == [b.sources for b in one[2 * rank: 2 * rank + 2]]
        assert len(reads[rank]) == sum(len(b.sources) for b in mine)
        for b in mine:  # THD: whole documents, positions restart at each boundary, no padding
            lens = (b.cu_seqlens[1:] - b.cu_seqlens[:-1]).tolist()
            assert b.num_tokens == sum(lens) <= 64 and "<pad>" not in b.sources
            assert b.position_ids[0].tolist() == [i for n in lens for i in range(n)]
    assert not set(reads[0]) & set(reads[1])
    # a stream built short and grown (rebuilt at twice the size) draws the same samples
    short = IndexedData(_data_cfg(blend=blend, split="90,10,0"), 1, 4, 1, 0, 1, 0, str(tmp_path / "cache"))
    assert len(short.train) < nxt
    assert short.train.plan(0, 200, 64)[0] == groups and len(short.train) >= nxt


def _sft_args(tiny_dir, train, valid, out, steps, **extra):
    args = [f"model.hf_dir={tiny_dir}", f"data.train={train}", f"data.valid={valid}", "data.micro_batch_tokens=128",
            "data.global_batch_tokens=256", "data.max_tokens=64", f"train.steps={steps}", f"train.out={out}",
            "optim.lr=3e-3", "optim.decay_style=constant", "lora.enabled=false", "wandb.mode=disabled",
            "train.progress=false"]
    return args + [f"{k}={v}" for k, v in extra.items()]


@pytest.mark.slow
def test_indexed_sft_gives_jsonl_losses_and_resumes_after_a_kill_at_the_next_samples(tiny_dir, tmp_path):
    from recipes.sft import run

    train = reverse_task(tmp_path / "train.jsonl", 96, 0)
    valid = reverse_task(tmp_path / "valid.jsonl", 8, 1)
    preprocess([train], tmp_path / "train_idx", tiny_dir, progress=False)
    preprocess([valid], tmp_path / "valid_idx", tiny_dir, progress=False)
    # within an epoch both paths see the same documents in the same micro-batches: same losses
    over = dict(train={"steps": 4, "eval_every": 2})
    jl = run(sft_cfg(tiny_dir, tmp_path / "j", data={"train": train, "valid": valid}, **over))
    ix = run(sft_cfg(tiny_dir, tmp_path / "x", data={"train": str(tmp_path / "train_idx"),
                                                  "valid": str(tmp_path / "valid_idx")}, **over))
    assert [h["loss"] for h in ix["history"]] == [h["loss"] for h in jl["history"]]
    assert ix["val"] == jl["val"] and len(ix["val"]) == 3
    assert ix["history"][-1]["data/consumed_samples"] < 96  # still epoch 0

    # kill a run (SIGKILL) right after a checkpoint, resume it, compare with an uninterrupted run
    out = tmp_path / "killed"
    args = _sft_args(tiny_dir, tmp_path / "train_idx", tmp_path / "valid_idx", out, 200, **{"train.save_every": 2})
    log = tmp_path / "killed.log"
    with open(log, "w") as f:  # its own session: the kill takes any helper process with it
        proc = subprocess.Popen(torchrun_cmd("-m recipes.main", "sft", *args, nproc=1), env=child_env(),
                                stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 240
        while not (out / "latest").is_file() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    killed_at = int((out / "latest").read_text())
    assert proc.returncode == -signal.SIGKILL and 2 <= killed_at < 200, log.read_text()[-2000:]
    resumed = run(sft_cfg(tiny_dir, tmp_path / "r", data={"train": str(tmp_path / "train_idx"),
                                                       "valid": str(tmp_path / "valid_idx")},
                       train={"steps": killed_at + 3, "eval_every": 0, "out": str(out)}))
    full = run(sft_cfg(tiny_dir, tmp_path / "f", data={"train": str(tmp_path / "train_idx"),
                                                    "valid": str(tmp_path / "valid_idx")},
                    train={"steps": killed_at + 3, "eval_every": 0}))
    assert len(resumed["history"]) == 3
    tail = full["history"][killed_at:]
    assert [h["data/consumed_samples"] for h in resumed["history"]] == [h["data/consumed_samples"] for h in tail]
    assert [h["loss"] for h in resumed["history"]] == [h["loss"] for h in tail]


def test_indexed_config_that_cannot_load_fails_before_work_naming_the_field(tiny_dir, tmp_path):
    from glm5_mcore.config import GLM5Config
    from recipes.sft import validate

    preprocess([_mixed_rows(tmp_path / "a.jsonl", 6, 0)], tmp_path / "a", tiny_dir, progress=False)
    preprocess([_mixed_rows(tmp_path / "b.jsonl", 9, 1)], tmp_path / "b", tiny_dir, progress=False)
    mixed = tmp_path / "mixed"  # a's tokens with b's loss mask
    mixed.mkdir()
    for f in ("tokens.bin", "tokens.idx"):
        (mixed / f).write_bytes((tmp_path / "a" / f).read_bytes())
    for f in ("loss_mask.bin", "loss_mask.idx"):
        (mixed / f).write_bytes((tmp_path / "b" / f).read_bytes())
    glm5 = GLM5Config.from_hf_dir(tiny_dir)
    a = str(tmp_path / "a")
    for data, msg in (({"train": str(tmp_path / "nope")}, "nope: not an indexed dataset"),
                      ({"train": str(mixed)}, "loss_mask: the loss-mask stream does not match"),
                      ({"train": "", "blend": [0.7, a, 0.3, str(tmp_path / "c")]}, "c: not an indexed dataset"),
                      ({"train": "", "blend": [-1, a]}, "data.blend: weights must be positive"),
                      ({"train": a, "blend": [1.0, a]}, "data.train and data.blend: give one"),
                      ({"train": a, "split": "x"}, "data.split='x'"),
                      ({"train": a, "valid": str(tmp_path / "a.jsonl")}, "needs indexed validation data"),
                      ({"train": str(tmp_path / "a.jsonl"), "valid": a}, "needs jsonl validation data"),
                      ({"train": a, "valid": a, "split": "9,1"}, "data.split and data.valid: give one")):
        cfg = sft_cfg(tiny_dir, tmp_path / "c", data={"valid": None, **data})
        with pytest.raises((ValueError, FileNotFoundError), match=msg):
            validate(cfg, glm5, 1)
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["loss_mask.bin", "loss_mask.idx", "summary.json",
                                                                  "tokens.bin", "tokens.idx"]

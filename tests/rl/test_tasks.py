"""RL on the tasks users bring (issue 31): verl-format prompt sets in jsonl / parquet / HF datasets folders,
GLM-5's chat template as transformers applies it, and reward functions in worker processes (timeouts,
crashes and raises cost one sample each and are counted; math-verify scores as verl's scorer does)."""

import json
import multiprocessing as mp
import sys
import textwrap

import pytest

from rl.config import RewardCfg
from rl.tasks.datasets import PromptDataError
from rl.tasks.rewards import RewardScorer
from rl.tasks.proc_pool import ProcessPool
from rl.tasks.prompts import read_prompts
from tests.support.launch import run_child

GLM5_SPECIAL = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                "<|assistant|>", "<|observation|>", "<|begin_of_image|>", "<|end_of_image|>", "<think>",
                "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<arg_key>",
                "</arg_key>", "<arg_value>", "</arg_value>"]
"""GLM-5's added special tokens (its tokenizer_config.json), in id order after the base vocabulary."""
GLM5_TEMPLATE = (
    "[gMASK]<sop>{%- for m in messages -%}"
    "{%- if m.role == 'system' -%}<|system|>{{ m.content }}"
    "{%- elif m.role == 'user' -%}<|user|>{{ m.content }}"
    "{%- elif m.role == 'assistant' -%}<|assistant|></think>{{ m.content }}"
    "{%- elif m.role == 'tool' -%}<|observation|><tool_response>{{ m.content }}</tool_response>"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|assistant|><think>{%- endif -%}"
)
"""GLM-5's template reduced to its role markers (system / user / assistant with the thinking tags, tool
results under ``<|observation|>``), the generation prompt ``<|assistant|><think>``."""


def write_glm5_tokenizer(out, words: int = 64):
    """A tokenizer folder with GLM-5's special tokens, EOS ids and chat template over a word vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    out.mkdir(parents=True, exist_ok=True)
    vocab = {f"w{i}": i for i in range(words)} | {"<unk>": words}
    vocab |= {t: words + 1 + i for i, t in enumerate(GLM5_SPECIAL)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(GLM5_SPECIAL)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>", "model_max_length": 4096}))
    (out / "chat_template.jinja").write_text(GLM5_TEMPLATE)
    return vocab


def test_glm5_template_ids_of_a_two_turn_prompt(tmp_path):
    from transformers import AutoTokenizer

    v = write_glm5_tokenizer(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    row = {"prompt": [{"role": "system", "content": "w1"}, {"role": "user", "content": "w2 w3"},
                      {"role": "assistant", "content": "w4"}, {"role": "user", "content": "w5"}],
           "data_source": "d", "reward_model": {"ground_truth": "7"}}
    (tmp_path / "p.jsonl").write_text(json.dumps(row) + "\n")
    p = read_prompts(tmp_path / "p.jsonl", tok, chat_template=False, max_tokens=64)[0]
    want = [v[t] for t in ["[gMASK]", "<sop>", "<|system|>", "w1", "<|user|>", "w2", "w3", "<|assistant|>",
                           "</think>", "w4", "<|user|>", "w5", "<|assistant|>", "<think>"]]
    assert p.ids == want, (p.ids, want)
    assert p.ground_truth == "7" and p.data_source == "d"


def _verl_rows():
    """Rows as verl's gsm8k preprocessor writes them (the tiny tokenizer's words as text)."""
    return [{"data_source": "openai/gsm8k", "ability": "math",
             "prompt": [{"role": "user", "content": f"w{i} w{i + 1} w{i + 2}"}],
             "reward_model": {"style": "rule", "ground_truth": str(i * 3)},
             "extra_info": {"split": "train", "index": i, "answer": f"w{i} #### {i * 3}"}} for i in range(6)]


def _write_all(tmp_path, rows):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "t_hf"))
    return [tmp_path / "t.jsonl", tmp_path / "t.parquet", tmp_path / "t_hf"]


def test_jsonl_parquet_and_hf_folder_give_the_same_prompts(tiny_dir, tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    sets = [read_prompts(p, tok, chat_template=False, max_tokens=64) for p in _write_all(tmp_path, _verl_rows())]
    first = sets[0]
    assert [p.ground_truth for p in first] == [str(i * 3) for i in range(6)]
    assert first[0].text == tok.apply_chat_template([{"role": "user", "content": "w0 w1 w2"}], tokenize=False,
                                                    add_generation_prompt=True)
    assert first[2].extra == {"split": "train", "index": 2, "answer": "w2 #### 6", "ability": "math"}
    for other in sets[1:]:
        assert [(p.ids, p.text, p.ground_truth, p.data_source, p.extra) for p in other] == \
               [(p.ids, p.text, p.ground_truth, p.data_source, p.extra) for p in first]


def test_column_map_and_bad_rows_name_file_row_and_column(tiny_dir, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    rows = [{"question": "w1 w2", "sol": {"final": "3"}, "src": "mine"}, {"question": "w3", "sol": {"final": "4"},
                                                                          "src": "mine"}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "m.parquet")
    got = read_prompts(tmp_path / "m.parquet", tok, True, 64,
                       columns={"prompt": "question", "ground_truth": "sol.final", "data_source": "src"})
    assert [(p.ground_truth, p.data_source) for p in got] == [("3", "mine"), ("4", "mine")]
    assert got[1].text == tok.apply_chat_template([{"role": "user", "content": "w3"}], tokenize=False,
                                                  add_generation_prompt=True)
    with pytest.raises(PromptDataError, match=r"m\.parquet row 0: no column 'answer' \(data.columns.ground_truth\)"):
        read_prompts(tmp_path / "m.parquet", tok, True, 64, columns={"prompt": "question", "ground_truth": "answer"})
    bad = [{"prompt": [{"role": "user", "content": "w1"}], "ground_truth": 1},
           {"prompt": [{"role": "user", "content": 5}], "ground_truth": 1}]
    pq.write_table(pa.Table.from_pylist([{"prompt": "w1", "ground_truth": 1}, {"prompt": None, "ground_truth": 1}]),
                   tmp_path / "b.parquet")
    with pytest.raises(PromptDataError, match=r"b\.parquet row 1: column 'prompt' must be a string or a list"):
        read_prompts(tmp_path / "b.parquet", tok, False, 64)
    (tmp_path / "b.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad))
    with pytest.raises(PromptDataError, match=r"b\.jsonl:2: column 'prompt' message 0 must be"):
        read_prompts(tmp_path / "b.jsonl", tok, False, 64)
    with pytest.raises(PromptDataError, match=r"x\.csv: unknown prompt set format"):
        (tmp_path / "x.csv").write_text("a\n")
        read_prompts(tmp_path / "x.csv", tok, False, 64)


USER_FNS = textwrap.dedent('''
    import ctypes, time

    def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        """A verl-style reward module: hangs, segfaults or raises on some responses."""
        if solution_str == "hang":
            time.sleep(3600)
        if solution_str == "segv":
            ctypes.string_at(0)
        if solution_str == "raise":
            raise KeyError("no such key")
        return float(solution_str == str(ground_truth)) + extra_info["bonus"]
''')


@pytest.mark.slow  # worker processes
def test_worker_modules_import_without_torch():
    """A reward or tool worker process imports the module of its function: the built-in rewards'
    (``rl.tasks.rewards``) and the toy tool's (``rl.tasks.envs``) load no torch (~2 s per worker start)."""
    code = ("import sys, rl.tasks.rewards, rl.tasks.envs, rl.tasks.proc_pool; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    out = run_child([sys.executable, "-c", code]).stdout.strip().splitlines()[-1]
    assert out == "[]", out


def test_reward_pool_hang_crash_raise_cost_one_sample_each(tmp_path):
    (tmp_path / "my_reward.py").write_text(USER_FNS)
    cfg = RewardCfg(fn=f"{tmp_path / 'my_reward.py'}:compute_score", num_workers=2, timeout_s=3.0,
                    timeout_score=-1.0, error_score=-2.0)
    sols = ["4", "hang", "5", "segv", "raise", "4"]
    scorer = RewardScorer(cfg)
    try:
        scores, counts, events = scorer.score(["d"] * 6, sols, [4] * 6, [{"bonus": 0.5}] * 6)
        assert scores == [1.5, -1.0, 0.5, -2.0, -2.0, 1.5]
        assert counts == {"reward/timeouts": 1.0, "reward/errors": 2.0}
        assert "timed out on sample 1" in events[0] and "died of SIGSEGV" in events[1]
        assert "sample 4" in events[2] and "KeyError" in events[2]
        again, counts, _ = scorer.score(["d"] * 2, ["4", "5"], [4, 4], [{"bonus": 0.0}] * 2)  # workers replaced
        assert again == [1.0, 0.0] and counts == {"reward/timeouts": 0.0, "reward/errors": 0.0}
        # a batch sent in chunks: the calls after a hang or a crash in the same chunk still run
        many = ["4" if i % 3 else "5" for i in range(40)]
        many[6], many[23] = "hang", "segv"
        scores, counts, _ = scorer.score(["d"] * 40, many, [4] * 40, [{"bonus": 0.0}] * 40)
        want = [{"4": 1.0, "5": 0.0, "hang": -1.0, "segv": -2.0}[m] for m in many]
        assert scores == want and counts == {"reward/timeouts": 1.0, "reward/errors": 1.0}
    finally:
        scorer.close()


@pytest.mark.slow  # worker processes
def test_reward_pool_workers_killed_while_idle_are_replaced(tmp_path):
    """A worker that died between two batches (SIGKILLed while idle) is replaced and its calls run: they were
    all errors "arguments cannot be sent (BrokenPipeError)" (the CI failure of the colocated two-node job)."""
    (tmp_path / "my_reward.py").write_text(USER_FNS)
    pool = ProcessPool(f"{tmp_path / 'my_reward.py'}:compute_score", workers=2, timeout_s=30.0)
    calls = [("d", s, 4, {"bonus": 0.0}) for s in ("4", "5", "4", "4")]
    try:
        assert [o.value for o in pool.map(calls)] == [1.0, 0.0, 1.0, 1.0]
        workers = [p for p in mp.active_children() if p.name.startswith("glm5-")]
        assert len(workers) == 2
        for p in workers:
            p.kill()
            p.join(10)
        got = pool.map(calls)
        assert [(o.status, o.value) for o in got] == [("ok", 1.0), ("ok", 0.0), ("ok", 1.0), ("ok", 1.0)], got
    finally:
        pool.close()


def _answer_strings():
    """A few hundred model outputs against ground truths: boxed / GSM8K #### / bare answers, right,
    wrong and equivalent forms (fractions, decimals, LaTeX, thousands separators, negatives)."""
    golds = ["72", "-3", "0.5", "\\frac{1}{2}", "1234", "\\sqrt{2}", "3.14", "10", "2/3", "x+1", "18", "0"]
    forms = {"72": ["72", "72.0", "71", "seventy-two"], "-3": ["-3", "3", "-3.0"],
             "0.5": ["\\frac{1}{2}", "1/2", "0.50", "0.6"], "\\frac{1}{2}": ["0.5", "\\frac12", "\\frac{2}{4}", "2"],
             "1234": ["1,234", "1234", "1243"], "\\sqrt{2}": ["\\sqrt{2}", "2^{1/2}", "1.41", "\\sqrt{3}"],
             "3.14": ["3.14", "\\pi", "3.140"], "10": ["10", "010", "10.5", "1e1"], "2/3": ["\\frac{2}{3}", "4/6",
                                                                                     "0.66"],
             "x+1": ["1+x", "x+1", "x-1"], "18": ["18", "$18$", "18 apples"], "0": ["0", "-0", "o"]}
    out = []
    for g in golds:
        for p in forms[g]:
            out += [(f"So the answer is \\boxed{{{p}}}.", g), (f"We get {p} #### {p}", g), (f"#### {p}", g),
                    (f"The final answer is ${p}$", g), (p, g), (f"Reasoning... then \\boxed{{{p}}} and done", g),
                    (f"First 5, then {p}", g), (f"\\boxed{{{p}}} \\boxed{{99}}", g)]
    out += [("no answer here", "5"), ("", "5"), ("\\boxed{}", "5"), ("\\boxed{5", "5")]
    return out


@pytest.mark.slow  # worker processes
def test_math_verifier_scores_as_verls_math_verify(tmp_path):
    from verl.utils.reward_score.math_verify import compute_score as verl_math_verify

    pairs = _answer_strings()
    assert len(pairs) >= 300
    scorer = RewardScorer(RewardCfg(fn="math", num_workers=2, timeout_s=60.0))
    try:
        ours, counts, _ = scorer.score(["math"] * len(pairs), [s for s, _ in pairs], [g for _, g in pairs],
                                       [{}] * len(pairs))
    finally:
        scorer.close()
    theirs = [verl_math_verify(s, g) for s, g in pairs]
    diff = [(pairs[i], ours[i], theirs[i]) for i in range(len(pairs)) if ours[i] != theirs[i]]
    assert not diff, diff[:10]
    assert counts == {"reward/timeouts": 0.0, "reward/errors": 0.0}
    assert 0.2 < sum(ours) / len(ours) < 0.8  # both right and wrong answers in the set
    # a raw GSM8K answer as ground truth is cut to its final number
    gsm, _, _ = RewardScorer(RewardCfg(fn="math", num_workers=0)).score(
        ["openai/gsm8k"] * 2, ["#### 1,234", "\\boxed{72}"], ["so 1000 + 234 #### 1,234", "3 * 24 = 72\n#### 72"],
        [{}, {}])
    assert gsm == [1.0, 1.0]


def test_resume_fingerprint_of_an_hf_folder_follows_its_data(tmp_path):
    """Was: an HF ``save_to_disk`` folder's fingerprint was its path, so a resume on a folder rewritten with
    other rows passed the resume guard; now it is every file's size and digest (moving it is no change)."""
    import datasets

    from glm5_mcore.training.resume import compare, file_fingerprint

    rows = _verl_rows()
    hf = _write_all(tmp_path, rows)[2]
    before = file_fingerprint(str(hf))
    assert "state.json" in before["files"] and any(k.endswith(".arrow") for k in before["files"])
    moved = tmp_path / "moved"
    hf.rename(moved)
    assert file_fingerprint(str(moved)) == before
    datasets.Dataset.from_list(rows[::-1]).save_to_disk(str(hf))
    changed = compare({"data": {"train": before}}, {"data": {"train": file_fingerprint(str(hf))}})
    assert any(line.startswith("data.train.files.data-00000-of-00001.arrow.xxh3: ") for line in changed), changed


# ------------------------------------------------------------------------------------------------------
# issue 42: verifiers that die with their timeout, bad values named, a function that always fails stops
# the run; data a tokenizer cannot take refused naming the row, parquet shard folders read
# ------------------------------------------------------------------------------------------------------
HOSTILE_FNS = textwrap.dedent('''
    import os, subprocess, sys, time

    def spawn_and_hang(data_source, solution_str, ground_truth, extra_info=None):
        """A verifier whose helper process outlives it unless its whole process group dies."""
        if solution_str not in ("timeout", "raise"):
            return 1.0
        child = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        open(extra_info["pidfile"], "w").write(str(child.pid))
        if solution_str == "raise":
            raise RuntimeError("gave up")
        time.sleep(3600)

    def huge(data_source, solution_str, ground_truth, extra_info=None):
        return 10 ** 400

    def array(data_source, solution_str, ground_truth, extra_info=None):
        import numpy
        return numpy.array([0.5, 1.0])

    def fork_twice(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str == "fork":
            os.fork()  # both copies return
        return 1.0

    def wrong_signature(solution_str):
        return 1.0
''')


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(") ", 1)[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow  # worker processes
@pytest.mark.parametrize("how", ["timeout", "raise"])
def test_a_verifiers_children_die_with_its_timeout_or_error(tmp_path, how):
    """Red team: a verifier that starts ``python -c "while True: pass"`` was counted as a timeout and its
    worker replaced, but the child kept running at 100 % CPU."""
    import time

    (tmp_path / "fns.py").write_text(HOSTILE_FNS)
    pidfile = tmp_path / "child.pid"
    scorer = RewardScorer(RewardCfg(fn=f"{tmp_path / 'fns.py'}:spawn_and_hang", num_workers=1, timeout_s=3.0))
    try:
        _, counts, _ = scorer.score(["d", "d"], [how, "4"], [1, 1], [{"pidfile": str(pidfile)}] * 2)
        assert counts["reward/timeouts" if how == "timeout" else "reward/errors"] >= 1, counts
        child = int(pidfile.read_text())
        for _ in range(100):
            if not _alive(child):
                break
            time.sleep(0.05)
        assert not _alive(child), f"the verifier's child {child} outlived the failed call"
    finally:
        scorer.close()


@pytest.mark.slow  # worker processes
def test_bad_values_and_forks_are_named_and_counted(tmp_path):
    """Red team: a reward returning 10**400 or a numpy array was a raw OverflowError / TypeError; one that
    forked and returned in both processes sent two results; one with the wrong signature failed every
    sample and the run went on (rc 0)."""
    from rl.tasks.rewards import RewardError

    (tmp_path / "fns.py").write_text(HOSTILE_FNS)
    fn = f"{tmp_path / 'fns.py'}"
    for name, shown in (("huge", "1000000000000"), ("array", "array([0.5, 1. ])")):
        scorer = RewardScorer(RewardCfg(fn=f"{fn}:{name}", num_workers=1))
        try:
            with pytest.raises(RewardError) as e:
                scorer.score(["d"], ["x"], [1], [{}])
            assert f"reward function {fn}:{name} returned {shown}" in str(e.value) and "for sample 0" in str(e.value)
        finally:
            scorer.close()
    scorer = RewardScorer(RewardCfg(fn=f"{fn}:fork_twice", num_workers=1, error_score=-1.0))
    try:
        scores, counts, events = scorer.score(["d"] * 4, ["a", "fork", "b", "c"], [1] * 4, [{}] * 4)
        assert scores == [1.0, -1.0, 1.0, 1.0] and counts == {"reward/timeouts": 0.0, "reward/errors": 1.0}, scores
        assert "returned twice" in events[0], events
    finally:
        scorer.close()
    scorer = RewardScorer(RewardCfg(fn=f"{fn}:wrong_signature", num_workers=1))
    try:
        with pytest.raises(RewardError, match=r"wrong_signature: 3 of the 3 samples of this scoring call failed .*"
                                              r"reward.max_error_fraction=1; first: .*TypeError"):
            scorer.score(["d"] * 3, ["a", "b", "c"], [1] * 3, [{}] * 3)
    finally:
        scorer.close()


def test_text_a_tokenizer_cannot_take_and_unknown_roles_name_the_row(tiny_dir, tmp_path):
    """Red team: a lone surrogate in a prompt was an 11-frame traceback from the tokenizer; a chat role
    outside the template's (``hacker``) was accepted silently."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    (tmp_path / "s.jsonl").write_text('{"prompt": "w1 w2", "ground_truth": 1}\n'
                                      '{"prompt": [{"role": "user", "content": "w1 \\ud800 w2"}], "ground_truth": 1}\n')
    with pytest.raises(PromptDataError, match=r"s\.jsonl:2: column 'prompt\[0\]\.content': a lone surrogate "
                                              r"'\\ud800' at character 3"):
        read_prompts(tmp_path / "s.jsonl", tok, False, 64)
    (tmp_path / "r.jsonl").write_text('{"prompt": [{"role": "hacker", "content": "w1"}], "ground_truth": 1}\n')
    with pytest.raises(PromptDataError, match=r"r\.jsonl:1: column 'prompt' message 0 has the role 'hacker'; the "
                                              r"chat template's roles are system, user, assistant, observation, tool"):
        read_prompts(tmp_path / "r.jsonl", tok, False, 64)


def test_a_folder_of_parquet_shards_is_one_dataset(tiny_dir, tmp_path):
    """Red team: a folder of parquet shards, as verl users have them, was refused as "not a datasets
    save_to_disk folder"; now read with pyarrow's dataset reader, shard by shard in path order."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    rows = _verl_rows()
    one = _write_all(tmp_path, rows)[1]
    shards = tmp_path / "shards"
    (shards / "year=2024").mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows[:2]), shards / "train-00000-of-00003.parquet")
    pq.write_table(pa.Table.from_pylist(rows[2:5]), shards / "train-00001-of-00003.parquet")
    pq.write_table(pa.Table.from_pylist(rows[5:]), shards / "year=2024" / "train-00002-of-00003.parquet")
    (shards / "_SUCCESS").write_text("")
    (shards / "README.md").write_text("shards")
    want = [(p.ids, p.text, p.ground_truth, p.data_source, p.extra) for p in read_prompts(one, tok, False, 64)]
    got = read_prompts(shards, tok, False, 64)
    assert [(p.ids, p.text, p.ground_truth, p.data_source, p.extra) for p in got] == want
    assert got[3].where == f"{shards / 'train-00001-of-00003.parquet'} row 1", got[3].where
    (shards / "year=2024" / "train-00002-of-00003.parquet").write_bytes(b"not parquet")
    with pytest.raises(PromptDataError, match="year=2024/train-00002-of-00003.parquet"):
        read_prompts(shards, tok, False, 64)
    with pytest.raises(PromptDataError, match="neither a datasets save_to_disk folder"):
        (tmp_path / "empty").mkdir()
        read_prompts(tmp_path / "empty", tok, False, 64)

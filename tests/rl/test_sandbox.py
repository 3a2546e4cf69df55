"""The code sandbox and tool episodes (issue 31 item 3, issue 34 classes 6, 8 and 13): sandbox limits
hold (CPU loop, 2 GB allocation, fork bomb, network, writes outside its folder), tool calls parse from
GLM-5's and the JSON format, and a tool that hangs, raises, floods or overflows the context becomes an
observation (the episode goes on, the assistant header after a cut observation kept)."""

import os
import textwrap
import time
from types import SimpleNamespace

import pytest

from rl.tasks.code_env import python_tool
from rl.tasks.episodes import ToolRunner, run_episodes
from rl.rollout.base import Request, Result, SamplingParams
from rl.tasks.sandbox import SandboxLimits, run_python
from rl.tasks.tool_parse import ToolCall, ToolCallError, parse_tool_calls


def _nobody_processes() -> int:
    n = 0
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid == 65534:
                n += 1
        except FileNotFoundError:
            pass
    return n


@pytest.mark.slow  # starts sandboxed interpreters / worker processes
def test_sandbox_cpu_memory_and_fork_bomb_limits():
    t0 = time.perf_counter()
    r = run_python("while True: pass", SandboxLimits(cpu_s=1, wall_s=30))
    assert r.status == "killed" and time.perf_counter() - t0 < 20, r
    assert "CPU-time limit" in python_tool("", '<tool_call>python<arg_key>code</arg_key><arg_value>while 1: pass'
                                           '</arg_value></tool_call>', cpu_s=1)
    r = run_python("x = bytearray(2 * 1024 ** 3)\nprint('allocated')")
    assert r.status == "error" and "MemoryError" in r.stderr and "allocated" not in r.stdout, r
    before = _nobody_processes()
    t0 = time.perf_counter()
    r = run_python("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
                   SandboxLimits(wall_s=3, cpu_s=2))
    assert r.status in ("timeout", "killed") and time.perf_counter() - t0 < 20, r
    time.sleep(0.5)
    assert _nobody_processes() <= before  # every forked process died with the call
    r = run_python("print(sum(range(10)))")
    assert (r.status, r.stdout) == ("ok", "45\n")


@pytest.mark.slow  # starts sandboxed interpreters / worker processes
def test_sandbox_no_network_and_no_writes_outside_its_folder(tmp_path):
    r = run_python("import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('127.0.0.1', 22))\nprint('up')")
    if not r.isolated_network:
        pytest.skip("this machine allows no network namespace (unshare failed); the sandbox says so")
    assert r.status == "error" and "up" not in r.stdout and "OSError" in r.stderr, r
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # even a folder anyone may write stays untouched
    tag = os.urandom(4).hex()
    code = textwrap.dedent(f"""
        import os
        open("mine.txt", "w").write("ok")
        print(sorted(os.listdir(".")))
        for p in ["/tmp/glm5-escape-{tag}", "../glm5-escape-{tag}", "{shared}/escape", "/var/tmp/glm5-escape-{tag}"]:
            try:
                open(p, "w").write("x")
            except OSError as e:
                print("refused", type(e).__name__)
    """)
    r = run_python(code)
    assert r.status == "ok" and r.stdout.startswith("['mine.txt']"), r
    assert not any(p.exists() for p in [shared / "escape"] + [__import__("pathlib").Path(d) / f"glm5-escape-{tag}"
                                                              for d in ("/tmp", "/var/tmp")])
    assert not list(__import__("pathlib").Path("/tmp").glob(f"glm5-sandbox-*/mine.txt"))  # its folder is gone
    r = run_python("print('x' * 10 ** 7)", SandboxLimits(max_output_bytes=1000))
    assert len(r.stdout) == 1000 and r.truncated


def test_tool_calls_parse_from_glm5_and_json_formats():
    glm = ("let me run it\n<tool_call>python\n<arg_key>code</arg_key>\n<arg_value>print(1)\nprint(2)</arg_value>"
           "\n</tool_call>")
    assert parse_tool_calls(glm) == [ToolCall("python", {"code": "print(1)\nprint(2)"})]
    two = "<tool_call>f<arg_key>n</arg_key><arg_value>3</arg_value></tool_call><tool_call>g</tool_call>"
    assert parse_tool_calls(two) == [ToolCall("f", {"n": 3}), ToolCall("g", {})]
    js = 'I will call {"name": "python", "arguments": {"code": "print(3)"}} now'
    assert parse_tool_calls(js) == [ToolCall("python", {"code": "print(3)"})]
    hermes = '<tool_call>{"name": "python", "arguments": "{\\"code\\": \\"1\\"}"}</tool_call>'
    assert parse_tool_calls(hermes) == [ToolCall("python", {"code": "1"})]
    for bad, why in [("just words", "no tool call found"), ("<tool_call>{oops</tool_call>", "not valid JSON"),
                     ("<tool_call>python<arg_key>code</arg_key>print(1)</tool_call>", "arg_key")]:
        with pytest.raises(ToolCallError, match=why):
            parse_tool_calls(bad)


@pytest.mark.slow  # starts sandboxed interpreters / worker processes
def test_python_tool_observations_say_what_went_wrong():
    call = "<tool_call>python<arg_key>code</arg_key><arg_value>{}</arg_value></tool_call>"
    assert python_tool("", call.format("print(6 * 7)")) == "42"
    assert "ZeroDivisionError" in python_tool("", call.format("1/0")) and "exit code 1" in python_tool("", call.format("1/0"))
    assert "wall limit of 1 s" in python_tool("", call.format("import time; time.sleep(60)"), wall_s=1)
    assert python_tool("", "<tool_call>shell<arg_key>cmd</arg_key><arg_value>ls</arg_value></tool_call>").startswith(
        "error: unknown tool 'shell'")
    assert python_tool("", "no call at all").startswith("error: no tool call found")
    assert "[output cut at 100 bytes]" in python_tool("", call.format("print('y' * 5000)"), max_output_bytes=100)
    # only the last assistant turn is read (earlier turns' calls already ran)
    assert python_tool("", call.format("print(1)") + "<|observation|>\n1<|assistant|>\n" + call.format("print(2)")) == "2"


# ------------------------------------------------------------------------------------------------------
# tool episodes: hangs, raises, cut observations, the context (issue 34 classes 6, 8, 13)
# ------------------------------------------------------------------------------------------------------
ENVS = textwrap.dedent('''
    import time

    def hang(prompt, episode):
        time.sleep(3600)

    def boom(prompt, episode):
        raise KeyError("no such record")

    def flood(prompt, episode, words=1000):
        return " ".join(["w9"] * words)
''')


class ScriptedEngine:
    """Turn t of every episode samples ``turns[t]`` (token strings); the HF engine's context check."""

    def __init__(self, tok, turns, max_positions=512):
        self.ids = [tok.convert_tokens_to_ids(t) for t in turns]
        self.max_positions = max_positions
        self.turn = {}

    def generate(self, requests, params, batched=True):
        out = []
        for r in requests:
            if len(r.prompt_ids) + params.max_new_tokens > self.max_positions:
                raise ValueError(f"request {r.key}: prompt {len(r.prompt_ids)} + max_new_tokens "
                                 f"{params.max_new_tokens} exceeds max_position_embeddings={self.max_positions}")
            t = self.turn.get(r.key, 0)
            self.turn[r.key] = t + 1
            ids = [self.ids[min(t, len(self.ids) - 1)]]
            out.append(Result(r.key, ids, [-0.5], "stop" if ids[0] in params.stop_token_ids else "length"))
        return out


def _mt(**over):
    base = dict(tool_call_stop_tokens=["w5"], max_assistant_turns=3, max_tool_response_length=64,
                observation_role="observation", env="", env_kwargs={}, tool_workers=1, tool_timeout_s=60.0)
    return SimpleNamespace(**{**base, **over})


def _episode(tiny_dir, tmp_path, env, max_positions=512, turns=("w5", "w7"), **over):
    """(tokenizer, prompt ids, the episode's Result, the env's observation text of one call)."""
    from transformers import AutoTokenizer

    (tmp_path / "envs.py").write_text(ENVS)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    mt = _mt(env=f"{tmp_path / 'envs.py'}:{env}", **over)
    runner = ToolRunner.from_config(mt)
    try:
        (text, _), = runner([("w1", "w5")])
        engine = ScriptedEngine(tok, list(turns), max_positions)
        prompt = tok.encode("w1 w2 w3", add_special_tokens=False)
        res = run_episodes(engine, tok, runner, [Request((0, 0), prompt, 1)],
                           SamplingParams(1.0, 1.0, 1, (tok.eos_token_id,)), mt)[0]
    finally:
        runner.close()
    return tok, prompt, res, text


@pytest.mark.slow  # starts sandboxed interpreters / worker processes
def test_a_tool_that_never_returns_is_stopped_and_the_episode_goes_on(tiny_dir, tmp_path):
    t0 = time.perf_counter()
    tok, _, res, text = _episode(tiny_dir, tmp_path, "hang", tool_timeout_s=2.0)
    assert time.perf_counter() - t0 < 40
    assert f"env={tmp_path / 'envs.py'}:hang) did not return within 2 s" in text, text
    assert res.tool_stats["timeouts"] == 1 and res.mask[-1] == 1  # the policy's next turn came after it


def test_a_tool_that_raises_is_an_observation_naming_the_env(tiny_dir, tmp_path):
    tok, _, res, text = _episode(tiny_dir, tmp_path, "boom", tool_workers=0)
    assert f"rollout.multi_turn.env={tmp_path / 'envs.py'}:boom) raised KeyError" in text, text
    assert res.tool_stats["errors"] == 1 and res.mask[-1] == 1


def test_a_cut_observation_keeps_its_assistant_header(tiny_dir, tmp_path):
    tok, _, res, _ = _episode(tiny_dir, tmp_path, "flood", turns=("w5", "w5", "w8"), max_tool_response_length=6,
                            tool_workers=0)
    k = res.mask.index(0)
    obs = tok.convert_ids_to_tokens(res.response_ids[k: k + 6])
    assert obs[0] == "<|observation|>" and obs[-1] == "<|assistant|>" and obs[1:-1] == ["w9"] * 4, obs
    assert res.mask[k: k + 6] == [0] * 6 and res.mask[k + 6] == 1 and res.tool_stats["cut"] == 2


def test_an_observation_longer_than_the_context_is_cut_to_fit(tiny_dir, tmp_path):
    tok, prompt, res, _ = _episode(tiny_dir, tmp_path, "flood", max_positions=40, turns=("w5", "w5", "w8"),
                                  max_tool_response_length=10 ** 6, tool_workers=0)
    assert len(prompt) + len(res.response_ids) <= 40
    toks = tok.convert_ids_to_tokens(res.response_ids)
    assert toks.count("<|assistant|>") >= 1 and res.tool_stats["cut"] >= 1
    assert res.tool_stats["dropped"] == 1  # the second call found the context full: the episode ended there


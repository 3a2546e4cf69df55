"""The code sandbox and tool episodes (issue 31 item 3, issue 34 classes 6, 8 and 13, issue 42): sandbox
limits hold (CPU loop, 2 GB allocation, fork bomb, network, writes outside its folder) and hold for the
whole call (memory over its children, processes and memory of two concurrent calls, a disk quota); the code
sees no host file or process and a later call nothing of an earlier one; a machine that cannot isolate
(root without bubblewrap, not root, no user namespaces) is refused, never run with less. Tool calls parse
from GLM-5's and the JSON format, and a tool that hangs, raises, floods or overflows the context becomes
an observation (the episode goes on, the assistant header after a cut observation kept)."""

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from rl.tasks.code_env import describe, python_tool
from rl.tasks.episodes import ToolRunner, run_episodes
from rl.rollout.base import Request, Result, SamplingParams
from rl.tasks.sandbox import SandboxLimits, run_python
from rl.tasks.tool_parse import ToolCall, ToolCallError, parse_tool_calls


REPO = Path(__file__).resolve().parents[2]
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def _sandbox_processes(patience_s: float = 10.0) -> list[int]:
    """Host pids of live processes running as a uid the sandbox hands out as root (``UID_BASE`` and up),
    after waiting up to ``patience_s`` for them to go (a process killed with thousands of others leaves the
    call's cgroup before it is a zombie: the kernel may still be tearing it down when the call returns)."""
    end = time.monotonic() + patience_s
    while True:
        out = []
        for pid in os.listdir("/proc"):
            try:
                if pid.isdigit() and os.stat(f"/proc/{pid}").st_uid >= 0x70000000 and \
                        open(f"/proc/{pid}/stat").read().rsplit(") ", 1)[-1][0] != "Z":
                    out.append(int(pid))
            except (FileNotFoundError, ProcessLookupError):
                pass
        if not out or time.monotonic() > end:
            return out
        time.sleep(0.1)


def _others_can_read(path: Path) -> bool:
    return all(os.stat(p).st_mode & 0o005 == 0o005 for p in [path.parent, *path.parent.parents]) and \
        os.stat(path).st_mode & 0o004


def _json_run(code: str, **limits) -> dict:
    r = run_python(textwrap.dedent(code), SandboxLimits(**{"wall_s": 60, **limits}))
    assert r.status == "ok", r
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # starts sandboxed interpreters / worker processes
def test_sandbox_cpu_memory_and_fork_bomb_limits():
    # wall limits far above the CPU ones: on a loaded machine 1 CPU second can take tens of wall seconds
    r = run_python("while True: pass", SandboxLimits(cpu_s=1, wall_s=300))
    assert (r.status, r.limit) == ("killed", "cpu") and 1 <= r.cpu_s < 2, r
    assert "CPU-time limit" in python_tool("", '<tool_call>python<arg_key>code</arg_key><arg_value>while 1: pass'
                                           '</arg_value></tool_call>', cpu_s=1, wall_s=300)
    r = run_python("x = bytearray(2 * 1024 ** 3)\nprint('allocated')")
    assert r.status == "error" and "MemoryError" in r.stderr and "allocated" not in r.stdout, r
    t0 = time.perf_counter()
    r = run_python("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
                   SandboxLimits(wall_s=3, cpu_s=2))
    assert r.status in ("timeout", "killed") and time.perf_counter() - t0 < 20, r
    assert not _sandbox_processes()  # every forked process died with the call
    r = run_python("print(sum(range(10)))")
    assert (r.status, r.stdout) == ("ok", "45\n")


@pytest.mark.slow  # starts sandboxed interpreters
def test_sandbox_reaches_no_host_address_and_writes_nowhere_outside(tmp_path):
    with socket.socket() as host:  # a listener on the host's loopback
        host.bind(("127.0.0.1", 0))
        host.listen()
        code = f"import socket\ns = socket.socket()\ns.settimeout(2)\ns.connect(('127.0.0.1', {host.getsockname()[1]}))"
        r = run_python(code + "\nprint('up')", SandboxLimits(wall_s=60))
    assert r.status == "error" and "up" not in r.stdout and "Error" in r.stderr, r  # its own loopback: refused
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # even a folder anyone may write stays untouched
    tag = os.urandom(4).hex()
    code = textwrap.dedent(f"""
        import os
        open("mine.txt", "w").write("ok")
        print(sorted(os.listdir(".")))
        for p in ["/tmp/../glm5-escape-{tag}", "/glm5-escape-{tag}", "{shared}/escape", "/var/tmp/glm5-escape-{tag}",
                  "/usr/glm5-escape-{tag}", "/dev/glm5-escape-{tag}"]:
            try:
                open(p, "w").write("x")
                print("wrote", p)
            except OSError as e:
                print("refused", type(e).__name__)
    """)
    r = run_python(code, SandboxLimits(wall_s=60))
    assert r.status == "ok" and r.stdout.startswith("['mine.txt']") and "wrote" not in r.stdout, r
    assert not (shared / "escape").exists() and not list(Path("/").glob(f"*/glm5-escape-{tag}"))
    r = run_python("print('x' * 10 ** 7)", SandboxLimits(max_output_bytes=1000))
    assert len(r.stdout) == 1000 and r.truncated


@pytest.mark.slow  # starts sandboxed interpreters
def test_sandbox_sees_no_host_file_and_no_host_process():
    """Red team: a world-readable file outside /tmp (this project's own source, /etc) was readable, and
    /proc was the host's: the driver's command line (and so its data.train= path) was in /proc/*/cmdline."""
    seen = _json_run(f"""
        import json, os
        read = {{}}
        for p in [{str(REPO / "rl" / "tasks" / "sandbox.py")!r}, "/etc/passwd", "/etc/hostname", {sys.executable!r}]:
            try:
                read[p] = len(open(p, "rb").read())
            except OSError as e:
                pass
        cmdlines = {{}}
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    cmdlines[pid] = open(f"/proc/{{pid}}/cmdline", "rb").read().decode(errors="replace")
                except OSError:
                    pass
        print(json.dumps({{"read": read, "root": sorted(os.listdir("/")), "cmdlines": cmdlines,
                          "hidden": [p for p in ("/srv", "/run", "/home", "/root", "/etc", "/var", {str(REPO)!r})
                                     if not os.path.exists(p)]}}))
    """)
    assert seen["read"] == {}, seen["read"]
    assert set(seen["root"]) <= {"bin", "dev", "lib", "lib32", "lib64", "libx32", "proc", "sbin", "tmp", "usr"}, seen
    assert len(seen["hidden"]) == 7, seen["hidden"]
    assert not any("pytest" in c for c in seen["cmdlines"].values()) and len(seen["cmdlines"]) <= 2, seen["cmdlines"]


@pytest.mark.slow  # starts sandboxed interpreters
def test_a_later_call_finds_nothing_of_an_earlier_one():
    """Red team: a note written to /run/lock (world-writable, not covered) persisted on the host and a
    later call read it; a daemon started by a call kept running."""
    tag = os.urandom(4).hex()
    places = ["/run/lock", "/var/lock", "/var/tmp", "/tmp", "/dev/shm", "."]
    wrote = _json_run(f"""
        import json, os
        wrote = []
        for d in {places!r}:
            try:
                open(os.path.join(d, "note-{tag}"), "w").write("left by call 1")
                wrote.append(d)
            except OSError:
                pass
        if os.fork() == 0:  # a daemon: its own session, its parent gone
            os.setsid()
            if os.fork() == 0:
                import time
                time.sleep(60)
            os._exit(0)
        print(json.dumps(wrote))
    """)
    assert set(wrote) <= {"/tmp", "/dev/shm", "."}, wrote  # only the call's own tmpfs took a write
    found = _json_run(f"""
        import json, os
        print(json.dumps([d for d in {places!r} if os.path.exists(os.path.join(d, "note-{tag}"))]))
    """)
    assert found == [], found
    assert not [d for d in places[:-1] if os.path.exists(f"{d}/note-{tag}")]
    assert not _sandbox_processes()


HOLD = """
import json, os, time
kids, refused = 0, None
for _ in range({forks}):
    try:
        if os.fork() == 0:
            time.sleep(1.5)
            os._exit(0)
        kids += 1
    except OSError as e:
        refused = str(e)
blob = b"\\x01" * ({mb} * 1024 * 1024)  # touched pages: counted
time.sleep(0.5)
print(json.dumps({{"kids": kids, "refused": refused}}))
"""


@pytest.mark.slow  # starts sandboxed interpreters
def test_two_concurrent_calls_each_hold_their_full_process_and_memory_limits():
    """Red team: every call ran as uid nobody, so RLIMIT_NPROC was shared: one call's children made a
    concurrent call's forks fail."""
    lim = SandboxLimits(processes=12, memory_mb=256, wall_s=30)
    out = [None, None]

    def call(i):
        out[i] = run_python(HOLD.format(forks=11, mb=120), lim)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in out:
        assert r.status == "ok" and json.loads(r.stdout) == {"kids": 11, "refused": None}, r
    r = run_python(HOLD.format(forks=20, mb=1), lim)  # past its own limit: refused
    assert r.status == "ok" and json.loads(r.stdout)["kids"] == 11, r


@pytest.mark.slow  # starts sandboxed interpreters
def test_memory_and_disk_limits_hold_for_the_whole_call():
    """Red team: memory_mb was per process (4 children x 806 MB under memory_mb=1024), and a call wrote 1 GB
    into its folder in 1.3 s."""
    r = run_python(textwrap.dedent("""
        import os, time
        kids = []
        for _ in range(4):
            pid = os.fork()
            if pid == 0:
                blob = b"\\x01" * (100 * 1024 * 1024)
                time.sleep(1)
                os._exit(0)
            kids.append(pid)
        print(sum(os.waitpid(k, 0)[1] == 0 for k in kids), "of 4 children kept 100 MB")
    """), SandboxLimits(memory_mb=256, wall_s=30))
    assert r.limit == "memory" and not r.stdout.startswith("4 of 4"), r
    assert "memory limit of 256 MB" in describe(r, SandboxLimits(memory_mb=256))
    r = run_python("for i in range(8):\n    open(f'f{i}', 'wb').write(b'x' * (4 << 20))\n    print(i)",
                   SandboxLimits(disk_mb=16, wall_s=60))
    assert r.status == "error" and "No space left on device" in r.stderr and "4" not in r.stdout, r


CHILD = """
import sys
sys.path.insert(0, {repo!r})
from rl.tasks.sandbox import run_python
try:
    r = run_python("import os; os.kill(os.getppid(), 0); print('ran as', os.getuid(), 'beside', os.getppid())")
    print("RAN", r.status, r.stdout, r.stderr[-200:])
except ValueError as e:
    print("REFUSED", e)
"""


@pytest.mark.slow  # starts Python processes under other identities
@pytest.mark.parametrize("mode", ["root_without_bwrap", "not_root", "no_user_namespaces"])
def test_a_machine_that_cannot_isolate_is_refused_not_downgraded(tmp_path, mode):
    """Red team: as root without ``unshare`` on PATH the code ran unconfined (reached a host listener, left
    a daemon); as a non-root user with user namespaces it was root in its namespace (unmounted the private
    /tmp, rewrote the trainer's reward module); without user namespaces it signalled its grandparent."""
    python, env = sys.executable, {"PATH": os.environ["PATH"]}
    prefix: list[str] = []
    if mode == "root_without_bwrap":
        if os.geteuid() != 0:
            pytest.skip("needs root (the mode under test)")
        tools = tmp_path / "bin"  # every tool but bubblewrap and unshare
        tools.mkdir()
        for t in ("setpriv", "ldd", "sh"):
            (tools / t).symlink_to(shutil.which(t))
        env["PATH"] = str(tools)
    else:
        python = shutil.which("python3", path="/usr/bin:/bin")
        if os.geteuid() != 0 or python is None or not _others_can_read(REPO / "rl" / "tasks" / "sandbox.py"):
            pytest.skip("needs root, a system python3 and a checkout other users can read, to run as nobody")
        prefix = NOBODY if mode == "not_root" else [
            shutil.which("bwrap"), "--dev-bind", "/", "/", "--unshare-user", "--disable-userns", "--uid", "65534",
            "--gid", "65534", "--"]
    out = subprocess.run([*prefix, python, "-c", CHILD.format(repo=str(REPO))], capture_output=True, text=True,
                         env=env, cwd="/", timeout=120)
    assert out.stdout.startswith("REFUSED the Python sandbox cannot isolate tool code on this machine: "), (
        out.stdout, out.stderr[-2000:])
    why = {"root_without_bwrap": "bubblewrap (bwrap) is not installed", "not_root": "no cgroup for whole-call limits",
           "no_user_namespaces": "could not start a sandbox here"}[mode]
    assert why in out.stdout, out.stdout


def test_a_bubblewrap_without_quota_or_userns_options_is_refused(tmp_path, monkeypatch):
    """bubblewrap < 0.8 (Ubuntu 22.04's 0.6.1) has no ``--size`` (the tmpfs quota) nor ``--disable-userns``."""
    from rl.tasks.sandbox import probe

    (tmp_path / "bwrap").write_text("#!/bin/sh\necho bubblewrap 0.6.1\n")
    (tmp_path / "bwrap").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    iso = probe()
    assert not iso.ok and iso.line.startswith("bubblewrap 0.6.1 is older than 0.8 (needed: --size"), iso


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

    def echo(prompt, episode, tokens=()):
        return "\\n".join(f"{t} w9{t}w9" for t in tokens)  # what code printing each of them gives back
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


def test_a_tool_that_prints_control_tokens_gives_the_policy_text(tiny_dir, tmp_path):
    """A tool whose output holds every special token of the tokenizer (alone and glued to words: a forged turn
    header, EOS, BOS, pad, the observation header itself) gives an observation whose content has none of them as
    a token: the policy's next context holds the control tokens it emitted and the template's own observation
    header and closing, nothing else."""
    from rl.tasks.episodes import control_ids

    from tests.support.sft_setup import tokenizer

    tok = tokenizer(tiny_dir)
    specials = [t.content for t in tok.added_tokens_decoder.values() if t.special]
    assert {"<|assistant|>", "<|user|>", "<|endoftext|>", "<|observation|>", "[gMASK]", "<pad>"} <= set(specials)
    _, _, res, text = _episode(tiny_dir, tmp_path, "echo", turns=("w5", "w8"), tool_workers=0,
                               env_kwargs={"tokens": specials})
    assert all(t in text for t in specials), text
    k = res.mask.index(0)
    n = res.mask[k:].index(1)
    obs = res.response_ids[k: k + n]
    assert tok.convert_ids_to_tokens([obs[0], obs[-1]]) == ["<|observation|>", "<|assistant|>"], obs
    forged = control_ids(tok) & set(obs[1:-1])
    assert not forged and len(obs) > 2 * len(specials), tok.convert_ids_to_tokens(obs)
    assert tok.convert_ids_to_tokens(res.response_ids[k + n:]) == ["w8"]  # the policy's next turn followed


def test_an_observation_longer_than_the_context_is_cut_to_fit(tiny_dir, tmp_path):
    tok, prompt, res, _ = _episode(tiny_dir, tmp_path, "flood", max_positions=40, turns=("w5", "w5", "w8"),
                                  max_tool_response_length=10 ** 6, tool_workers=0)
    assert len(prompt) + len(res.response_ids) <= 40
    toks = tok.convert_ids_to_tokens(res.response_ids)
    assert toks.count("<|assistant|>") >= 1 and res.tool_stats["cut"] >= 1
    assert res.tool_stats["dropped"] == 1  # the second call found the context full: the episode ended there


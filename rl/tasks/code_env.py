"""The code tool for multi-turn episodes: the turn's tool call run in the Python sandbox (``rl.tasks.sandbox``).

``rollout.multi_turn.env=rl.tasks.code_env.python_tool`` with ``env_kwargs`` = the sandbox limits
(``cpu_s``, ``memory_mb``, ``file_mb``, ``processes``, ``wall_s``, ``max_output_bytes``). The last assistant
turn of the episode (the text after the last assistant header) is parsed for tool calls (``rl.tasks.tool_parse``:
GLM-5's ``<tool_call>`` format or JSON); each ``python`` call (argument ``code``) runs in a fresh sandbox
and its output becomes the observation. A bad call — unparsable, an unknown tool, a missing argument,
a timeout, a crash, a limit hit, output over the budget — becomes an observation that says so.
"""

from __future__ import annotations

import signal

from rl.tasks.sandbox import SandboxLimits, SandboxResult, run_python
from rl.tasks.tool_parse import ToolCallError, parse_tool_calls

TOOLS = {"python": "code", "code_interpreter": "code", "execute_python": "code"}
"""Tool names this env runs, and the argument holding the code."""
ASSISTANT_HEADER = "<|assistant|>"
LIMIT_SIGNALS = {signal.SIGXCPU: "the CPU-time limit", signal.SIGXFSZ: "the file-size limit",
                 signal.SIGKILL: "a hard limit (CPU time or memory)"}


def describe(res: SandboxResult, lim: SandboxLimits) -> str:
    """The observation text of one sandbox run."""
    parts = []
    if res.stdout:
        parts.append(res.stdout.rstrip("\n"))
    if res.stderr:
        parts.append("stderr:\n" + res.stderr.rstrip("\n"))
    if res.status == "timeout":
        parts.append(f"error: stopped after the wall limit of {lim.wall_s:g} s")
    elif res.status == "killed":
        sig = (res.returncode - 128) if res.returncode and res.returncode > 128 else -(res.returncode or 0)
        why = LIMIT_SIGNALS.get(sig, f"signal {sig}")
        parts.append(f"error: killed by {why} (cpu {lim.cpu_s} s, memory {lim.memory_mb} MB, "
                     f"files {lim.file_mb} MB)")
    elif res.status == "error":
        parts.append(f"exit code {res.returncode}")
    if res.truncated:
        parts.append(f"[output cut at {lim.max_output_bytes} bytes]")
    return "\n".join(parts) if parts else "(no output)"


def python_tool(prompt: str, episode: str, **limits) -> str:
    """The ``rollout.multi_turn.env`` of the code tool (see the module docstring)."""
    lim = SandboxLimits(**limits)
    turn = episode.rsplit(ASSISTANT_HEADER, 1)[-1]
    try:
        calls = parse_tool_calls(turn)
    except ToolCallError as e:
        return f"error: {e}"
    out = []
    for i, call in enumerate(calls):
        arg = TOOLS.get(call.name)
        if arg is None:
            out.append(f"error: unknown tool {call.name!r} (tools: {', '.join(sorted(TOOLS))})")
        elif not isinstance(call.arguments.get(arg), str):
            out.append(f"error: tool {call.name!r} needs a string argument {arg!r}")
        else:
            out.append(describe(run_python(call.arguments[arg], lim), lim))
    return "\n".join(out)

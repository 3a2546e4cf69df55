"""The code tool for multi-turn episodes: the turn's tool call run in the Python sandbox (``rl.tasks.sandbox``).

``rollout.multi_turn.env=rl.tasks.code_env.python_tool`` with ``env_kwargs`` = the sandbox limits
(``SandboxLimits``: ``cpu_s``, ``memory_mb``, ``file_mb``, ``disk_mb``, ``processes``, ``open_files``,
``wall_s``, ``max_output_bytes``). The last assistant turn of the episode (the text after the last
assistant header) is parsed for tool calls (``rl.tasks.tool_parse``: GLM-5's ``<tool_call>`` format or
JSON); each ``python`` call (argument ``code``) runs in a fresh sandbox and its output becomes the
observation. A bad call — unparsable, an unknown tool, a missing argument, a timeout, a crash, a limit
hit, output over the budget — becomes an observation that says so. A sandbox that cannot be set up is
the env's error (``tool/errors``), never a call run with less isolation.

Before Ray starts (``rl.validate``), ``check_kwargs`` types ``env_kwargs`` against ``SandboxLimits`` and
``check_machine`` refuses a machine that cannot isolate the code (no bubblewrap, no user namespaces, no
cgroup), returning the line the run's log gets.
"""

from __future__ import annotations

import signal

from rl.tasks.sandbox import SandboxLimits, SandboxResult, isolation, run_python
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
    elif res.limit == "cpu":
        parts.append(f"error: killed by the CPU-time limit ({lim.cpu_s:g} CPU s for all the call's processes)")
    elif res.status == "killed":
        sig = (res.returncode - 128) if res.returncode and res.returncode > 128 else -(res.returncode or 0)
        why = ("the memory limit" if res.limit == "memory" and sig == signal.SIGKILL
               else LIMIT_SIGNALS.get(sig, f"signal {sig}"))
        parts.append(f"error: killed by {why} (cpu {lim.cpu_s:g} s, memory {lim.memory_mb} MB, "
                     f"files {lim.file_mb} MB)")
    elif res.status == "error":
        parts.append(f"exit code {res.returncode}")
    if res.limit == "memory" and res.status != "killed":
        parts.append(f"[a process was killed: the call's processes reached the memory limit of {lim.memory_mb} MB]")
    if res.forks_refused:
        parts.append(f"[{res.forks_refused} process start(s) refused: the limit is {lim.processes} processes]")
    if res.truncated:
        parts.append(f"[output cut at {lim.max_output_bytes} bytes]")
    return "\n".join(parts) if parts else "(no output)"


class PythonTool:
    """The ``rollout.multi_turn.env`` of the code tool (see the module docstring)."""

    def __call__(self, prompt: str, episode: str, **limits) -> str:
        lim = SandboxLimits.from_kwargs(limits)
        turn = episode.rsplit(ASSISTANT_HEADER, 1)[-1]
        try:
            calls = parse_tool_calls(turn)
        except ToolCallError as e:
            return f"error: {e}"
        out = []
        for call in calls:
            arg = TOOLS.get(call.name)
            if arg is None:
                out.append(f"error: unknown tool {call.name!r} (tools: {', '.join(sorted(TOOLS))})")
            elif not isinstance(call.arguments.get(arg), str):
                out.append(f"error: tool {call.name!r} needs a string argument {arg!r}")
            else:
                out.append(describe(run_python(call.arguments[arg], lim), lim))
        return "\n".join(out)

    @staticmethod
    def check_kwargs(kwargs: dict) -> None:
        """``rollout.multi_turn.env_kwargs`` typed against ``SandboxLimits`` (ValueError naming the key)."""
        SandboxLimits.from_kwargs(kwargs)

    @staticmethod
    def check_machine() -> str:
        """What the calls will run under; a ValueError where this machine cannot isolate them."""
        iso = isolation()
        if not iso.ok:
            raise ValueError(f"rollout.multi_turn.env=rl.tasks.code_env.python_tool: this machine cannot isolate "
                             f"tool code: {iso.line}")
        return f"tool sandbox: {iso.line}"


python_tool = PythonTool()

"""A tool env that attacks the code tool's sandbox (issue 42's red team, as a test and a run use it).

``write_env(folder, targets)`` writes ``folder/attack_env.py`` whose ``reader`` env runs each of the
policy's tool calls through ``rl.tasks.code_env.python_tool`` as usual and then a hostile call of its own:
it scans ``/proc/*/cmdline`` for a ``data.train=`` path (what found the answer key in the red team's run),
then tries to read that path and ``targets`` (the training file, this project's source, the model). Each
hostile call's result (JSON: the paths found, read and refused) goes to ``folder/observations.jsonl``, and
the observation the policy gets is both outputs. The env keeps the code tool's ``check_kwargs`` /
``check_machine`` (where the code tool has them), so the run is checked and logged as a code-tool run.
"""

from __future__ import annotations

from pathlib import Path

ATTACK = '''
import json, os
found = {"cmdline": [], "read": {}, "refused": {}, "pids": 0}
for pid in os.listdir("/proc"):
    if pid.isdigit():
        found["pids"] += 1
        try:
            args = open(f"/proc/{pid}/cmdline", "rb").read().decode(errors="replace").split("\\0")
        except OSError:
            continue
        found["cmdline"] += [a.split("=", 1)[1] for a in args if a.startswith("data.train=")]
for path in found["cmdline"] + TARGETS:
    try:
        found["read"][path] = len(open(path, "rb").read())
    except OSError as e:
        found["refused"][path] = type(e).__name__
print(json.dumps(found, sort_keys=True))
'''

ENV = '''
import json
from rl.tasks import code_env

LOG = {log!r}
ATTACK = {attack!r}
CALL = "<|assistant|><tool_call>python<arg_key>code</arg_key><arg_value>" + ATTACK + "</arg_value></tool_call>"


def reader(prompt, episode, **limits):
    mine = code_env.python_tool(prompt, episode, **limits)
    hostile = code_env.python_tool(prompt, CALL, **limits)
    with open(LOG, "a") as f:
        f.write(json.dumps({{"policy": mine, "hostile": hostile}}) + "\\n")
    return mine + "\\n" + hostile


for hook in ("check_kwargs", "check_machine"):
    if hasattr(code_env.python_tool, hook):
        setattr(reader, hook, getattr(code_env.python_tool, hook))
'''


def write_env(folder: Path, targets: list[str]) -> str:
    """The env's ``rollout.multi_turn.env`` value (``file.py:reader``); its log is ``folder/observations.jsonl``."""
    folder.mkdir(parents=True, exist_ok=True)
    attack = ATTACK.replace("TARGETS", repr([str(t) for t in targets]))
    (folder / "attack_env.py").write_text(ENV.format(log=str(folder / "observations.jsonl"), attack=attack))
    return f"{folder / 'attack_env.py'}:reader"

"""What the task settings (``reward``, ``rollout.multi_turn``) are refused for before Ray starts
(``rl.validate`` calls these): each a ``ValueError`` naming the field, instead of a raw ``OverflowError``
in a Ray actor or a run whose every update is skipped.

- ``check_reward``: ``reward.timeout_s`` finite and > 0, ``reward.num_workers`` >= 0, ``error_score`` /
  ``timeout_score`` finite numbers (a NaN score makes every advantage NaN), ``max_error_fraction`` in (0, 1];
- ``check_multi_turn``: ``tool_timeout_s`` finite and > 0, ``tool_workers`` >= 0, ``env`` importable, and
  the env's own ``check_kwargs(env_kwargs)`` and ``check_machine()`` where it has them (the code tool:
  ``SandboxLimits`` keys, types and ranges; bubblewrap, user namespaces and a cgroup on this machine); the
  code tool's ``wall_s`` inside ``tool_timeout_s`` (else the worker is killed before the sandbox's own limit);
- ``tool_lines``: the lines the run's log gets about the tool env (what the code tool runs under).
"""

from __future__ import annotations

import math
import numbers

from rl.tasks.code_env import PythonTool
from rl.tasks.proc_pool import resolve
from rl.tasks.sandbox import SandboxLimits

FIELD = "rollout.multi_turn.env"


def check_timeout(value, field: str) -> None:
    """A timeout: a finite number of seconds > 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{field}={value!r}: a timeout must be a finite number of seconds > 0")


def check_reward(r) -> None:
    check_timeout(r.timeout_s, "reward.timeout_s")
    if r.num_workers < 0:
        raise ValueError(f"reward.num_workers={r.num_workers} must be >= 0 (0: score in the driver)")
    for key in ("error_score", "timeout_score"):
        v = getattr(r, key)
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise ValueError(f"reward.{key}={v!r}: must be a finite number (it becomes the sample's reward; NaN or "
                             "inf would make the step's advantages and loss non-finite)")
    f = r.max_error_fraction
    if isinstance(f, bool) or not isinstance(f, numbers.Real) or not 0 < f <= 1:
        raise ValueError(f"reward.max_error_fraction={f!r}: must be in (0, 1] (the share of a scoring call's samples "
                         "whose reward call failed that stops the run; 1: only when all failed)")


def check_multi_turn(mt) -> None:
    check_timeout(mt.tool_timeout_s, "rollout.multi_turn.tool_timeout_s")
    if mt.tool_workers < 0:
        raise ValueError(f"rollout.multi_turn.tool_workers={mt.tool_workers} must be >= 0")
    env = resolve(mt.env, FIELD)
    kwargs = dict(mt.env_kwargs)
    check = getattr(env, "check_kwargs", None)
    if check is not None:
        check(kwargs)
    if isinstance(env, PythonTool) and mt.tool_workers:
        wall = SandboxLimits.from_kwargs(kwargs).wall_s
        if mt.tool_timeout_s <= wall:
            raise ValueError(f"rollout.multi_turn.tool_timeout_s={mt.tool_timeout_s:g} must exceed env_kwargs.wall_s="
                             f"{wall:g}: the tool worker would be killed before the sandbox's own wall limit")
    machine = getattr(env, "check_machine", None)
    if machine is not None:
        machine()


def tool_lines(mt) -> list[str]:
    """What the run's log says about the tool env (after ``check_multi_turn`` passed)."""
    machine = getattr(resolve(mt.env, FIELD), "check_machine", None) if mt.enable else None
    return [machine()] if machine is not None else []

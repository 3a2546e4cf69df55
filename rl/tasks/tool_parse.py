"""Tool calls parsed from a model's turn: GLM-5's format and a JSON format.

GLM-5 (its chat template's ``tool_calls`` rendering)::

    <tool_call>python<arg_key>code</arg_key><arg_value>print(1)</arg_value></tool_call>

(whitespace / newlines between the parts allowed; values are strings as the template writes them, a
JSON value where the template ``tojson``-ed a non-string is decoded). JSON (Hermes / Qwen / OpenAI
style), inside ``<tool_call>...</tool_call>`` or as the turn's last JSON object::

    {"name": "python", "arguments": {"code": "print(1)"}}

``parse_tool_calls(text)`` returns the calls in order, or raises ``ToolCallError`` with a one-line reason
that the episode feeds back to the policy as the observation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

TOOL_CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.S)
GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class ToolCallError(ValueError):
    """A turn's tool call that cannot be parsed; the message says why."""


@dataclass
class ToolCall:
    name: str
    arguments: dict = field(default_factory=dict)


def _from_json(obj, where: str) -> ToolCall:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise ToolCallError(f"{where}: a JSON tool call needs a string 'name'")
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # OpenAI style: arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError as e:
            raise ToolCallError(f"{where}: 'arguments' is a string but not JSON ({e.msg})") from None
    if not isinstance(args, dict):
        raise ToolCallError(f"{where}: 'arguments' must be an object")
    return ToolCall(obj["name"], args)


def _glm_value(v: str):
    s = v.strip()
    if s[:1] in "[{" or s in ("true", "false", "null") or re.fullmatch(r"-?\d+(\.\d+)?", s or "x"):
        try:
            return json.loads(s)
        except json.JSONDecodeError:
            pass
    return v


def _block(body: str, i: int) -> ToolCall:
    where = f"tool call {i}"
    s = body.strip()
    if s.startswith("{"):
        try:
            return _from_json(json.loads(s), where)
        except json.JSONDecodeError as e:
            raise ToolCallError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    name, _, rest = s.partition("<arg_key>")
    name = name.strip()
    if not name or not re.fullmatch(r"[\w.\-]+", name):
        raise ToolCallError(f"{where}: expected <tool_call>NAME<arg_key>..</arg_key><arg_value>..</arg_value>"
                            "</tool_call> or a JSON object")
    args = {k.strip(): _glm_value(v) for k, v in GLM_ARG.findall("<arg_key>" + rest if rest else "")}
    if rest and not args:
        raise ToolCallError(f"{where} ({name}): arguments not in <arg_key>..</arg_key><arg_value>..</arg_value> pairs")
    return ToolCall(name, args)


def _last_json_object(text: str):
    dec = json.JSONDecoder()
    for m in reversed([m.start() for m in re.finditer(r"\{", text)]):
        try:
            obj, _ = dec.raw_decode(text, m)
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and "name" in obj:
            return obj
    return None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls of one assistant turn (see the module docstring)."""
    blocks = TOOL_CALL.findall(text)
    if blocks:
        return [_block(b, i) for i, b in enumerate(blocks)]
    obj = _last_json_object(text)
    if obj is not None:
        return [_from_json(obj, "tool call 0")]
    raise ToolCallError("no tool call found: expected <tool_call>NAME<arg_key>..</arg_key><arg_value>..</arg_value>"
                        '</tool_call> or {"name": .., "arguments": {..}}')

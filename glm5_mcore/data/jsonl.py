"""One jsonl line → its JSON value, with the one error wording every reader of rows uses.

Shared by the SFT data reader (``glm5_mcore.data.sft.parse_line``, ``glm5 data preprocess``) and the RL
prompt reader (``rl.tasks.prompts.read_prompts``): a line that is not UTF-8 or not JSON is a bad row named
``file:line`` (and column), raised as the caller's own error type.
"""

from __future__ import annotations

import json
from typing import Any


def decode_json_line(line: bytes | str, where: str, error: type[Exception] = ValueError) -> Any:
    """The JSON value of one line (bytes: decoded as UTF-8). ``error(f"{where}: not valid UTF-8 (byte
    0x.. at column N)")`` or ``error(f"{where}: not valid JSON (<reason> at column N)")`` otherwise."""
    if isinstance(line, bytes):
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as e:
            raise error(f"{where}: not valid UTF-8 (byte 0x{line[e.start]:02x} at column {e.start + 1})") from None
    try:
        return json.loads(line)
    except json.JSONDecodeError as e:
        raise error(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None

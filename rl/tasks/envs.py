"""Tool environments for multi-turn episodes (``rollout.multi_turn.env``), and the toy tool task.

The toy tool task (``data.train=toy_tool``, preset ``configs/rl/tool_tiny.yaml``) is one a tiny random
GLM-5 can learn on CPU and that cannot be solved without the tool: the prompt is three random words;
a hidden value ``w{v}`` (v in [64, 118], a hash of the prompt's words, so not learnable from the prompt)
is returned only by the ``lookup`` tool, which the policy calls by sampling any of the words w64..w118
(the preset's tool-call stop tokens). The answer is the episode's last word ``w{j}``: reward 1 when the
episode called the tool and j < 64 and j ≡ v (mod 2); an answer that did not consult the tool scores 0
(so neither guessing nor memorising the training prompts pays). A random policy scores about 0.1.
The task's prompts are data (``rl.tasks.prompts``); the hidden value, the tool and the reward live here (a tool
worker process imports this module only: no torch).
"""

from __future__ import annotations

import hashlib
import re

OBS_REPEAT = 6

TOOL_WORDS = range(64, 119)
"""The words that call the tool (and the range of the hidden value)."""


def hidden_value(prompt_text: str) -> int:
    words = " ".join(re.findall(r"w\d+", prompt_text))
    h = int.from_bytes(hashlib.blake2b(words.encode(), digest_size=8).digest(), "little")
    return TOOL_WORDS[h % len(TOOL_WORDS)]


def toy_lookup_env(prompt: str, episode: str) -> str:
    """The ``lookup`` tool: the prompt's hidden value as a word, repeated ``OBS_REPEAT`` times (a record
    with the value in several fields: a tiny random model reads it through near-uniform attention)."""
    return " ".join([f"w{hidden_value(prompt)}"] * OBS_REPEAT)


def toy_lookup_reward(data_source, solution_str: str, ground_truth, extra_info=None) -> float:
    """1.0 when the episode (decoded without special tokens: call word, observation word, answer...) opens
    with a tool call, goes on past the observation, and its last word ``w{j}`` has j < 64 and
    j ≡ ground_truth (mod 2)."""
    words = [int(w) for w in re.findall(r"w(\d+)", solution_str)]
    if len(words) < 3 or words[0] not in TOOL_WORDS:
        return 0.0
    j = words[-1]
    return float(j < TOOL_WORDS.start and j % 2 == int(ground_truth))

"""Prompt sets for RL: a jsonl / parquet / HF datasets folder (``rl.tasks.datasets``), or the built-in toy task.

The toy task (``data.train=toy``) is one a tiny random GLM-5 can learn on CPU in minutes and whose
right answer depends on the prompt: the prompt is three random words ``w{b} w{c} w{a}``; a response
whose first word ``w{j}`` has ``j ≡ a (mod m)`` (a: the last word, one of ``keys`` key words) scores 1, anything else 0 (``rl.tasks.rewards.toy_residue``).
A constant policy — or one that ignores the prompt — scores 1/m; the default m = 2.

``token_ids(tokenizer, tokens, field, vocab)``: ids or token strings (stop tokens, tool-call tokens) as ids,
each checked against the tokenizer and the vocabulary.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from glm5_mcore.data.order import epoch_order
from rl.tasks.datasets import PromptDataError, iter_rows, render_prompt, row_fields
from rl.tasks.envs import hidden_value

TOY_SOURCE = "glm5_toy_residue"


@dataclass
class Prompt:
    index: int
    """Position in its set: with (step, sample) it seeds the sample's randomness."""
    ids: list[int]
    text: str
    ground_truth: Any = None
    data_source: str = ""
    extra: dict = field(default_factory=dict)
    where: str = ""
    """``file:line`` of a JSONL row (errors name it)."""


def toy_prompts(tokenizer, size: int, seed: int, modulus: int = 2, keys: int = 8) -> list[Prompt]:
    """``size`` toy prompts over the tokenizer's ``w{i}`` words (the ``glm5 tiny`` tokenizer)."""
    vocab = tokenizer.get_vocab()
    words = sorted((int(w[1:]) for w in vocab if w[:1] == "w" and w[1:].isdigit()))
    if len(words) < 2 * modulus:
        raise PromptDataError("data.train=toy needs a tokenizer with w0, w1, ... words (glm5 tiny's)")
    g = torch.Generator().manual_seed(seed)
    picks = torch.randint(len(words), (size, 3), generator=g)
    picks[:, 0] %= keys
    out = []
    for i, (a, b, c) in enumerate(picks.tolist()):
        text = f"w{words[b]} w{words[c]} w{words[a]}"
        out.append(Prompt(i, tokenizer.encode(text, add_special_tokens=False), text,
                          ground_truth=words[a] % modulus, data_source=TOY_SOURCE, extra={"modulus": modulus}))
    return out


def read_prompts(path: str | Path, tokenizer, chat_template: bool, max_tokens: int,
                 columns: Optional[dict] = None) -> list[Prompt]:
    """The rows of a jsonl / parquet / HF ``datasets`` folder (``rl.tasks.datasets``: verl's columns as they are,
    ``columns`` for other names); errors name the file, row and column."""
    out = []
    for where, row in iter_rows(path):
        f = row_fields(row, where, columns or {})
        text = render_prompt(tokenizer, f["prompt"], chat_template, where)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise PromptDataError(f"{where}: the prompt tokenizes to nothing")
        if len(ids) > max_tokens:
            raise PromptDataError(f"{where}: prompt has {len(ids)} tokens > data.max_prompt_tokens={max_tokens}")
        out.append(Prompt(len(out), ids, text, f["ground_truth"], str(f["data_source"] or Path(path).stem),
                          f["extra_info"], where))
    if not out:
        raise PromptDataError(f"{path}: no prompts")
    return out


def load_prompts(spec: Optional[str], tokenizer, *, chat_template: bool, max_tokens: int, toy_size: int,
                 seed: int, columns: Optional[dict] = None) -> list[Prompt]:
    if spec is None:
        return []
    if spec == "toy":
        return toy_prompts(tokenizer, toy_size, seed)
    if spec == "toy_tool":
        return toy_tool_prompts(tokenizer, toy_size, seed)
    return read_prompts(spec, tokenizer, chat_template, max_tokens, columns)


def next_prompts(prompts: list[Prompt], count: int, seed: int, pos: dict) -> list[Prompt]:
    """The next ``count`` prompts of the epoch stream; ``pos`` = {"epoch", "cursor"} is advanced
    (it goes into checkpoints, so a resumed run continues the same stream)."""
    if count > len(prompts):
        raise PromptDataError(f"data.prompts_per_step={count} exceeds the {len(prompts)} prompts of the set")
    if pos["cursor"] + count > len(prompts):
        pos["epoch"] += 1
        pos["cursor"] = 0
    order = epoch_order(len(prompts), seed, pos["epoch"])
    out = [prompts[int(i)] for i in order[pos["cursor"]: pos["cursor"] + count]]
    pos["cursor"] += count
    return out


TOOL_SOURCE = "glm5_toy_lookup"


def toy_tool_prompts(tokenizer, size: int, seed: int) -> list[Prompt]:
    """The toy prompts (``rl.tasks.prompts.toy_prompts``' words) with the hidden value's parity as ground truth."""
    out = []
    for p in toy_prompts(tokenizer, size, seed):
        out.append(Prompt(p.index, p.ids, p.text, ground_truth=hidden_value(p.text) % 2, data_source=TOOL_SOURCE))
    return out


def token_ids(tokenizer, tokens, field: str, vocab: int) -> list[int]:
    """``tokens`` (ints or token strings) as ids; a string the tokenizer does not know, or an id outside
    [0, ``vocab``), is a ValueError naming ``field``."""
    out = []
    for t in tokens:
        if isinstance(t, str):
            i = tokenizer.convert_tokens_to_ids(t)
            if i is None or i == tokenizer.unk_token_id:
                raise ValueError(f"{field}: {t!r} is not a token of the tokenizer")
        elif isinstance(t, bool) or not isinstance(t, int):
            raise ValueError(f"{field}: {t!r} is neither a token id nor a token string")
        else:
            i = t
        if not 0 <= int(i) < vocab:
            raise ValueError(f"{field}: id {i} is outside the vocabulary [0, {vocab})")
        out.append(int(i))
    return out

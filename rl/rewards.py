"""Reward functions, referenced by dotted path in the config (``reward.fn``).

Signature (verl's ``compute_score``): ``fn(data_source, solution_str, ground_truth, extra_info) ->
float`` (or a dict with a ``score`` key); with ``reward.batched`` the same arguments as lists and a
list of floats back. ``score_batch`` turns a bad output (None, NaN/inf, not a number, a list of the
wrong length) into a ``RewardError`` naming the function.

Built in: ``exact_match``, ``math_answer`` (last ``\\boxed{}`` or last number, compared as numbers
when both parse, fractions included) and ``toy_residue`` (the toy task of ``rl.tasks``).
"""

from __future__ import annotations

import importlib
import math
import re
from fractions import Fraction
from typing import Any, Callable, Optional


class RewardError(ValueError):
    pass


def load_fn(path: str) -> Callable:
    mod, _, name = path.rpartition(".")
    if not mod:
        raise RewardError(f"reward.fn={path!r}: expected a dotted path module.function")
    try:
        fn = getattr(importlib.import_module(mod), name)
    except (ImportError, AttributeError) as e:
        raise RewardError(f"reward.fn={path!r}: cannot import ({e})") from None
    if not callable(fn):
        raise RewardError(f"reward.fn={path!r} is not callable")
    return fn


def _as_score(v: Any, name: str, i: int) -> float:
    if isinstance(v, dict):
        if "score" not in v:
            raise RewardError(f"reward function {name} returned a dict without 'score' for sample {i}")
        v = v["score"]
    if v is None or isinstance(v, bool) or not isinstance(v, (int, float)) and not hasattr(v, "__float__"):
        raise RewardError(f"reward function {name} returned {v!r} for sample {i}; expected a finite number")
    f = float(v)
    if not math.isfinite(f):
        raise RewardError(f"reward function {name} returned {f} for sample {i}; expected a finite number")
    return f


def score_batch(fn: Callable, name: str, batched: bool, data_sources: list, solutions: list[str],
                ground_truths: list, extras: list, kwargs: Optional[dict] = None) -> list[float]:
    kwargs = kwargs or {}
    if batched:
        try:
            out = fn(data_sources, solutions, ground_truths, extras, **kwargs)
        except Exception as e:  # a user's function: name it, not a traceback
            raise RewardError(f"reward function {name} (batched) raised {type(e).__name__}: {e}") from None
        if not isinstance(out, (list, tuple)) and not hasattr(out, "tolist"):
            raise RewardError(f"reward function {name} (batched) returned {type(out).__name__}; expected a list")
        out = list(out.tolist() if hasattr(out, "tolist") else out)
        if len(out) != len(solutions):
            raise RewardError(f"reward function {name} (batched) returned {len(out)} scores for "
                              f"{len(solutions)} samples")
        return [_as_score(v, name, i) for i, v in enumerate(out)]
    scores = []
    for i, (d, s, g, e) in enumerate(zip(data_sources, solutions, ground_truths, extras)):
        try:
            v = fn(d, s, g, e, **kwargs)
        except Exception as err:  # a user's function: name it and the sample, not a traceback
            raise RewardError(f"reward function {name} raised {type(err).__name__}: {err} for sample {i} "
                              f"(data_source {d!r}, response {s[:80]!r})") from None
        scores.append(_as_score(v, name, i))
    return scores


# --------------------------------------------------------------------------------------------------
# built-in rewards
# --------------------------------------------------------------------------------------------------
def _norm(s: str) -> str:
    return re.sub(r"\s+", " ", s.strip().strip(".").lower())


def exact_match(data_source, solution_str: str, ground_truth, extra_info=None) -> float:
    """1.0 when the response equals the ground truth (case- and whitespace-insensitive)."""
    truths = ground_truth if isinstance(ground_truth, (list, tuple)) else [ground_truth]
    return float(any(_norm(solution_str) == _norm(str(t)) for t in truths))


_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")


def extract_answer(text: str) -> Optional[str]:
    """The last ``\\boxed{...}``, else the text after the last "answer is", else the last number."""
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    m = re.findall(r"answer is[:\s]*([^\n]+)", text, flags=re.I)
    if m:
        return m[-1].strip().rstrip(".")
    nums = _NUMBER.findall(text)
    return nums[-1] if nums else None


def _number(s: str) -> Optional[Fraction]:
    s = s.strip().replace(",", "").replace("$", "").replace(" ", "")
    s = re.sub(r"^\\d?frac\{(-?\d+)\}\{(\d+)\}$", r"\1/\2", s)
    try:
        return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None


def math_answer(data_source, solution_str: str, ground_truth, extra_info=None) -> float:
    """1.0 when the extracted final answer equals the ground truth (numerically when both parse)."""
    pred = extract_answer(solution_str)
    if pred is None:
        return 0.0
    gt = str(ground_truth)
    gt = extract_answer(gt) if "\\boxed" in gt else gt
    a, b = _number(pred), _number(gt)
    if a is not None and b is not None:
        return float(a == b)
    return float(_norm(pred) == _norm(gt))


def toy_residue(data_source, solution_str: str, ground_truth, extra_info=None) -> float:
    """The toy task: 1.0 when the response's first word ``w{j}`` has j ≡ ground_truth (mod m)."""
    m = int((extra_info or {}).get("modulus", 2))
    words = solution_str.split()
    if not words or not re.fullmatch(r"w\d+", words[0]):
        return 0.0
    return float(int(words[0][1:]) % m == int(ground_truth))

"""Reward functions, referenced by dotted path in the config (``reward.fn``).

Signature (verl's ``compute_score``): ``fn(data_source, solution_str, ground_truth, extra_info) ->
float`` (or a dict with a ``score`` key); with ``reward.batched`` the same arguments as lists and a
list of floats back. ``score_batch`` turns a bad output (None, NaN/inf, not a number, a list of the
wrong length) into a ``RewardError`` naming the function.

Built in (``reward.fn`` may name them without a module): ``math`` (``math_verify_score``: math-verify,
as verl's ``math_verify`` scorer; ``\\boxed{}`` and GSM8K ``####`` answers), ``exact_match``,
``math_answer`` (last ``\\boxed{}`` or last number, compared as numbers when both parse, fractions
included) and ``toy_residue`` (the toy task of ``rl.tasks.prompts``). ``reward.fn`` may also be verl's
``/path/to/file.py:compute_score``.

``RewardScorer`` runs the function in ``reward.num_workers`` worker processes (``rl.tasks.proc_pool``): a sample
whose call times out (``reward.timeout_s``), raises or kills its process scores ``reward.timeout_score`` /
``reward.error_score`` and is counted (``reward/timeouts``, ``reward/errors``) and named in the run's log;
the run goes on — unless the failed share of one scoring call reaches ``reward.max_error_fraction``
(default 1.0: every sample failed, e.g. a function with the wrong signature), which stops the run in one
line. Nothing a failed call started outlives it (``rl.tasks.proc_pool``: the worker's process group is
killed). ``reward.num_workers=0`` calls it in the driver (no isolation: a raise stops the run).
``rl.tasks.step_rewards.Rewards`` is what a step's sources call (the responses decoded, scored here, the
failures counted); it lives apart so that a worker process importing a built-in function does not import torch.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction
from typing import Any, Callable, Optional

from rl.tasks.proc_pool import ProcessPool, resolve

BUILTIN = {"math": "rl.tasks.rewards.math_verify_score", "exact_match": "rl.tasks.rewards.exact_match",
           "math_answer": "rl.tasks.rewards.math_answer", "toy_residue": "rl.tasks.rewards.toy_residue"}
"""Short names of the built-in rewards (``reward.fn=math``)."""
MAX_EVENTS = 3
"""Failed samples named in the log per kind and scoring call (the rest are counted)."""


class RewardError(ValueError):
    pass


def fn_path(name: str) -> str:
    return BUILTIN.get(name, name)


def load_fn(path: str) -> Callable:
    try:
        return resolve(fn_path(path), "reward.fn")
    except ValueError as e:
        raise RewardError(str(e)) from None


def _as_score(v: Any, name: str, i: int) -> float:
    """``v`` as a finite float; anything else is a RewardError naming the function, the sample and the value."""
    if isinstance(v, dict):
        if "score" not in v:
            raise RewardError(f"reward function {name} returned a dict without 'score' for sample {i}: "
                              f"{_short(v)}")
        v = v["score"]
    f = None
    if v is not None and not isinstance(v, bool) and (isinstance(v, (int, float)) or hasattr(v, "__float__")):
        try:
            f = float(v)
        except (TypeError, ValueError, OverflowError):  # 10**400, a numpy array of several numbers
            f = None
    if f is None or not math.isfinite(f):
        raise RewardError(f"reward function {name} returned {_short(v)} ({type(v).__name__}) for sample {i}; "
                          "expected a finite number")
    return f


def _short(v: Any, n: int = 80) -> str:
    text = repr(v)
    return text if len(text) <= n else text[: n - 3] + "..."


def score_batch(fn: Callable, name: str, batched: bool, data_sources: list, solutions: list[str],
                ground_truths: list, extras: list, kwargs: Optional[dict] = None) -> list[float]:
    kwargs = kwargs or {}
    if batched:
        try:
            out = fn(data_sources, solutions, ground_truths, extras, **kwargs)
        except Exception as e:  # a user's function: name it, not a traceback
            raise RewardError(f"reward function {name} (batched) raised {type(e).__name__}: {e}") from None
        return [_as_score(v, name, i) for i, v in enumerate(_batched_values(out, name, len(solutions)))]
    scores = []
    for i, (d, s, g, e) in enumerate(zip(data_sources, solutions, ground_truths, extras)):
        try:
            v = fn(d, s, g, e, **kwargs)
        except Exception as err:  # a user's function: name it and the sample, not a traceback
            raise RewardError(f"reward function {name} raised {type(err).__name__}: {err} for sample {i} "
                              f"(data_source {d!r}, response {s[:80]!r})") from None
        scores.append(_as_score(v, name, i))
    return scores


class RewardScorer:
    """``reward.fn`` over samples, in worker processes (see the module docstring)."""

    def __init__(self, cfg):
        self.cfg, self.name = cfg, cfg.fn
        self.fn = load_fn(cfg.fn)
        self.pool = (ProcessPool(fn_path(cfg.fn), cfg.num_workers, cfg.timeout_s, cfg.kwargs, "reward.fn")
                     if cfg.num_workers else None)

    def score(self, data_sources: list, solutions: list[str], ground_truths: list,
              extras: list) -> tuple[list[float], dict, list[str]]:
        """(scores, {"reward/timeouts", "reward/errors"}, events naming the failed samples)."""
        n, c = len(solutions), self.cfg
        if self.pool is None:
            return score_batch(self.fn, self.name, c.batched, data_sources, solutions, ground_truths, extras,
                               c.kwargs), {"reward/timeouts": 0.0, "reward/errors": 0.0}, []
        if c.batched:
            k = max(1, min(c.num_workers, n))
            chunks = [range(i * n // k, (i + 1) * n // k) for i in range(k)]
            calls = [tuple([a[j] for j in ch] for a in (data_sources, solutions, ground_truths, extras))
                     for ch in chunks]
        else:
            chunks = [range(i, i + 1) for i in range(n)]
            calls = list(zip(data_sources, solutions, ground_truths, extras))
        scores: list[float] = [0.0] * n
        counts, events = {"timeout": 0, "error": 0}, []
        for ch, out in zip(chunks, self.pool.map(calls)):
            if out.ok:
                vals = _batched_values(out.value, self.name, len(ch)) if c.batched else [out.value]
                for j, v in zip(ch, vals):
                    scores[j] = _as_score(v, self.name, j)
                continue
            kind = "timeout" if out.status == "timeout" else "error"
            for j in ch:
                scores[j] = c.timeout_score if kind == "timeout" else c.error_score
                counts[kind] += 1
                if counts[kind] <= MAX_EVENTS:
                    what = {"timeout": "timed out", "error": "raised", "crash": "crashed"}[out.status]
                    events.append(f"reward: {self.name} {what} on sample {j} (data_source {data_sources[j]!r}): "
                                  f"{out.message}; scored {scores[j]:g}")
        failed = counts["timeout"] + counts["error"]
        if n and failed >= c.max_error_fraction * n:
            raise RewardError(f"reward.fn={self.name}: {failed} of the {n} samples of this scoring call failed "
                              f"({counts['error']} raised or crashed, {counts['timeout']} timed out), reaching "
                              f"reward.max_error_fraction={c.max_error_fraction:g}; first: "
                              f"{events[0].removeprefix('reward: ')}")
        for kind in counts:
            if counts[kind] > MAX_EVENTS:
                events.append(f"reward: {counts[kind] - MAX_EVENTS} more samples with a {kind}")
        return scores, {"reward/timeouts": float(counts["timeout"]), "reward/errors": float(counts["error"])}, events

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def _batched_values(out: Any, name: str, n: int) -> list:
    if not isinstance(out, (list, tuple)) and not hasattr(out, "tolist"):
        raise RewardError(f"reward function {name} (batched) returned {type(out).__name__}; expected a list")
    out = list(out.tolist() if hasattr(out, "tolist") else out)
    if len(out) != n:
        raise RewardError(f"reward function {name} (batched) returned {len(out)} scores for {n} samples")
    return out


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


GSM8K_ANSWER = re.compile(r"####\s*(-?[0-9.,]+)")


def math_verify_score(data_source, solution_str: str, ground_truth, extra_info=None) -> float:
    """1.0 when math-verify finds the response's answer equal to the ground truth, else 0.0: the
    extraction and comparison of verl's ``verl.utils.reward_score.math_verify`` (gold as ``\\boxed{gt}``
    through LaTeX extraction; the response through expression then LaTeX extraction; any gold/pred pair
    verifying), run in this process (signal-based timeouts need the main thread: ``rl.tasks.proc_pool`` gives
    every worker one). A GSM8K ground truth ``"... #### 72"`` is cut to its final number first."""
    from math_verify.grader import verify
    from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig, parse

    gt = str(ground_truth)
    m = GSM8K_ANSWER.findall(gt)
    if m:
        gt = m[-1].replace(",", "").rstrip(".")
    gold = parse("\\boxed{" + gt + "}", (LatexExtractionConfig(),))
    pred = parse(solution_str, (ExprExtractionConfig(), LatexExtractionConfig()))
    if not gold or not pred:
        return 0.0
    return max(1.0 if any(verify(g, p) for g in gold) else 0.0 for p in pred)

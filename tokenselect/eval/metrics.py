"""Scorers, as the benchmarks define them. Every scorer returns a float in [0, 1] for one sample;
summaries report the mean times 100, as both benchmarks do.

InfiniteBench (``src/compute_scores.py``):
- passkey, number_string: the first run of digits in the prediction equals the answer
  (``get_score_one_passkey`` / ``get_score_one_number_string`` with ``first_int_match``).
- kv_retrieval: after turning newlines and ``: " ' . , ? ! { }`` into spaces, the answer is one of
  the prediction's words (``get_score_one_kv_retrieval``).

RULER (``scripts/eval/synthetic/constants.py``, ``scripts/eval/evaluate.py``): the prediction is
stripped and its control characters turned into newlines; then ``string_match_all`` (every task
here): the fraction of references found in it, case-insensitively. ``string_match_part`` (RULER's
qa tasks): 1 when any reference is found.
"""

from __future__ import annotations

import re

from .tasks import BENCHMARK

_KV_SEPARATORS = str.maketrans(dict.fromkeys("\n:\"'.,?!{}", " "))  # each of these characters to a space


def first_int(prediction: str) -> str:
    """The first maximal run of ASCII digits in ``prediction`` ('' when there is none)."""
    match = re.search(r"[0-9]+", prediction)
    return match.group(0) if match else ""


def passkey_score(prediction: str, answers: list[str]) -> float:
    """InfiniteBench passkey and number_string."""
    return float(first_int(prediction) == answers[0])


def kv_retrieval_score(prediction: str, answers: list[str]) -> float:
    """InfiniteBench kv_retrieval."""
    return float(answers[0] in prediction.translate(_KV_SEPARATORS).split())


def ruler_postprocess(prediction: str) -> str:
    """RULER's ``postprocess_pred``."""
    return re.sub(r"[\x00-\x1f]", "\n", prediction.strip()).strip()


def string_match_all(prediction: str, answers: list[str]) -> float:
    """RULER: fraction of the references contained in the prediction, ignoring case."""
    pred = prediction.lower()
    return sum(ref.lower() in pred for ref in answers) / len(answers)


def string_match_part(prediction: str, answers: list[str]) -> float:
    """RULER: 1 when any reference is contained in the prediction, ignoring case."""
    pred = prediction.lower()
    return float(any(ref.lower() in pred for ref in answers))


def score(task: str, prediction: str, answers: list[str]) -> float:
    """Score one prediction of ``task`` against its reference answers, in [0, 1]."""
    if task in ("passkey", "number_string"):
        return passkey_score(prediction, answers)
    if task == "kv_retrieval":
        return kv_retrieval_score(prediction, answers)
    if BENCHMARK.get(task) == "ruler":
        return string_match_all(ruler_postprocess(prediction), answers)
    raise ValueError(f"unknown task {task!r}")

"""What every task generator returns, and how a sample is sized to a target length in tokens."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

CountTokens = Callable[[str], int]
# build(n, depth, rng, length_tokens) -> Sample: a sample whose haystack holds n units (noise lines,
# prose words, JSON pairs, list words...). All randomness comes from rng, drawn in the same order
# whatever n is, so the needles stay the same while the haystack grows.
Builder = Callable[[int, float, random.Random, int], "Sample"]


@dataclass
class Sample:
    """One prompt and its reference answers.

    input: the whole prompt for a base model (the benchmark's template, answer prefix included).
    answer_prefix: the tail of ``input`` that a chat model gets as the start of its own turn
    (empty when the benchmark keeps it all in the user turn).
    """

    input: str
    answers: list[str]
    answer_prefix: str = ""
    meta: dict = field(default_factory=dict)

    @property
    def question(self) -> str:
        """``input`` without the answer prefix: the user turn of a chat prompt."""
        return self.input[: len(self.input) - len(self.answer_prefix)]


def largest_fitting(fits: Callable[[int], bool]) -> int:
    """Largest n >= 1 with fits(n), for fits monotone (true up to some n, false after): doubling, then
    binary search, as RULER sizes its haystacks. Raises ValueError when even n=1 does not fit."""
    if not fits(1):
        raise ValueError("the target length is too short for even the smallest haystack of this task")
    lo, hi = 1, 2
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo


def fit_sample(build: Builder, length_tokens: int, depth: float, seed: int, count_tokens: CountTokens) -> Sample:
    """The sample with the largest haystack whose prompt is at most ``length_tokens`` tokens."""
    def render(n: int) -> Sample:
        return build(n, depth, random.Random(seed), length_tokens)

    n = largest_fitting(lambda n: count_tokens(render(n).input) <= length_tokens)
    sample = render(n)
    sample.meta.update(haystack_units=n, tokens=count_tokens(sample.input))
    return sample

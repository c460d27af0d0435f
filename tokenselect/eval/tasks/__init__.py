"""Task generators: InfiniteBench ``passkey``, ``number_string``, ``kv_retrieval`` and RULER
``niah_*``, ``vt``, ``cwe``, ``fwe``, made offline from a seed and sized to a length in tokens.

    sample = make_sample("passkey", 4096, depth=0.5, rng=random.Random(0), count_tokens=count)
    sample.input, sample.answers, sample.answer_prefix, sample.meta

``count_tokens(text) -> int`` measures a prompt in the model's tokens; the haystack is the largest
whose prompt fits in ``length_tokens`` (doubling then binary search over the haystack size, as RULER
does). ``depth`` in [0, 1] places the needle (0 = start of the haystack, 1 = end); tasks without a
needle (``vt``, ``cwe``, ``fwe``) ignore it.
"""

from __future__ import annotations

import functools
import random

from . import aggregation, infinitebench, niah, tracing
from .base import Builder, CountTokens, Sample, fit_sample

TASKS: dict[str, Builder] = {
    "passkey": infinitebench.passkey,
    "number_string": infinitebench.number_string,
    "kv_retrieval": infinitebench.kv_retrieval,
    **{name: functools.partial(lambda cfg, n, depth, rng, length: niah.build(cfg, n, depth, rng), cfg)
       for name, cfg in niah.CONFIGS.items()},
    "vt": tracing.vt,
    "cwe": aggregation.cwe,
    "fwe": aggregation.fwe,
}
NEEDLE_TASKS = frozenset(TASKS) - {"vt", "cwe", "fwe"}
# Benchmark of each task, which picks its scorer and its generation budget.
BENCHMARK = {name: "infinitebench" if name in ("passkey", "number_string", "kv_retrieval") else "ruler"
             for name in TASKS}
# New tokens each benchmark lets the model write (InfiniteBench ``src/eval_utils.py``: 6 / 12 / 50; RULER
# ``synthetic.yaml``: per task).
MAX_NEW_TOKENS = {"passkey": 6, "number_string": 12, "kv_retrieval": 50, "vt": 30, "cwe": 120, "fwe": 50,
                  **{name: 128 for name in niah.CONFIGS}}


def make_sample(task: str, length_tokens: int, depth: float, rng: random.Random,
                count_tokens: CountTokens) -> Sample:
    """A sample of ``task`` whose prompt is at most ``length_tokens`` tokens (and as close as the
    haystack's granularity allows). Draws one number from ``rng``: the same rng state gives the same sample."""
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    seed = rng.getrandbits(64)
    sample = fit_sample(TASKS[task], length_tokens, depth, seed, count_tokens)
    sample.meta.update(task=task, target_tokens=length_tokens, seed=seed,
                       depth=depth if task in NEEDLE_TASKS else None)
    return sample


__all__ = ["Sample", "TASKS", "NEEDLE_TASKS", "BENCHMARK", "MAX_NEW_TOKENS", "make_sample"]

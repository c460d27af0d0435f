"""RULER needle-in-a-haystack tasks (``scripts/data/synthetic/niah.py`` and ``synthetic.yaml``).

Needles read "One of the special magic {type_needle_v} for {key} is: {value}." and hide in one of
three haystacks: ``noise`` (the grass-is-green line repeated, one per line), ``essay`` (prose, the
needles placed between sentences) or ``needle`` (every line a distractor needle with random key and
value). The sample's depth places the first queried needle; the other needles take random depths
from RULER's grid of 40 depths, as RULER places all of its needles.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from .base import Sample
from .haystack import NOISE, prose_slice, prose_words, random_value, split_sentences

TEMPLATE = ("Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the {type_needle_v} afterwards.\n{context}\n"
            "What are all the special magic {type_needle_v} for {query} mentioned in the provided text?")
ANSWER_PREFIX = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
DEPTHS = [round(100 * i / 39) for i in range(40)]  # np.round(np.linspace(0, 100, 40)), in percent


@dataclass(frozen=True)
class NiahConfig:
    """One row of RULER's ``synthetic.yaml`` for the niah task."""

    haystack: str  # noise | essay | needle
    type_k: str  # words | numbers | uuids
    type_v: str
    num_k: int = 1
    num_v: int = 1
    num_q: int = 1


CONFIGS = {
    "niah_single_1": NiahConfig("noise", "words", "numbers"),
    "niah_single_2": NiahConfig("essay", "words", "numbers"),
    "niah_single_3": NiahConfig("essay", "words", "uuids"),
    "niah_multikey_1": NiahConfig("essay", "words", "numbers", num_k=4),
    "niah_multikey_2": NiahConfig("needle", "words", "numbers"),
    "niah_multikey_3": NiahConfig("needle", "uuids", "uuids"),
    "niah_multivalue": NiahConfig("essay", "words", "numbers", num_v=4),
    "niah_multiquery": NiahConfig("essay", "words", "numbers", num_k=4, num_q=4),
}


def prompt_template(cfg: NiahConfig) -> tuple[str, str, str]:
    """(template, answer prefix, needle type word), singular when one value is asked, as RULER edits it."""
    template, prefix, type_v = TEMPLATE, ANSWER_PREFIX, cfg.type_v
    if cfg.num_q * cfg.num_v == 1:
        for old, new in [("Some", "A"), ("are all", "is"), ("are", "is"), ("answers", "answer")]:
            template, prefix = template.replace(old, new), prefix.replace(old, new)
        type_v = type_v[:-1]
    return template, prefix, type_v


def _insert(parts: list[str], needles: list[str], fractions: list[float]) -> list[str]:
    """``parts`` (haystack lines or sentences) with each needle put before part int(fraction * len(parts))."""
    slots = [int(f * len(parts)) for f in fractions]
    for slot, needle in sorted(zip(slots, needles), key=lambda x: x[0], reverse=True):
        parts.insert(slot, needle)
    return parts


def build(cfg: NiahConfig, n: int, depth: float, rng: random.Random) -> Sample:
    """A sample whose haystack has n units: noise lines, prose words, or distractor needle lines."""
    num_k = max(cfg.num_k, cfg.num_q)
    keys = [random_value(cfg.type_k, rng) for _ in range(num_k)]
    values = [[random_value(cfg.type_v, rng) for _ in range(cfg.num_v)] for _ in keys]
    queried = rng.sample(range(num_k), cfg.num_q)
    needles = [(i, NEEDLE.format(type_needle_v=cfg.type_v, key=keys[i], value=v))
               for i in range(num_k) for v in values[i]]
    rng.shuffle(needles)
    first = next(j for j, (i, _) in enumerate(needles) if i == queried[0])
    others = iter(rng.sample(DEPTHS, len(needles)))
    fractions = [depth if j == first else next(others) / 100 for j in range(len(needles))]
    texts = [text for _, text in needles]
    start = rng.randrange(len(prose_words())) if cfg.haystack == "essay" else 0

    if cfg.haystack == "essay":
        context = " ".join(_insert(split_sentences(prose_slice(n, start)), texts, fractions))
    else:
        if cfg.haystack == "noise":
            lines = [NOISE] * n
        else:
            lines = [NEEDLE.format(type_needle_v=cfg.type_v, key=random_value(cfg.type_k, rng),
                                   value=random_value(cfg.type_v, rng)) for _ in range(n)]
        context = "\n".join(_insert(lines, texts, fractions))

    query_keys = [keys[i] for i in queried]
    query = ", ".join(query_keys[:-1]) + ", and " + query_keys[-1] if len(query_keys) > 1 else query_keys[0]
    template, prefix, type_v = prompt_template(cfg)
    prefix = prefix.format(type_needle_v=type_v, query=query)
    prompt = template.format(type_needle_v=type_v, context=context, query=query)
    answers = [v for i in queried for v in values[i]]
    return Sample(prompt + prefix, answers, prefix)

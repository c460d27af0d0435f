"""Haystack material and random needle values shared by the task generators.

- ``NOISE``: the repeated filler sentence of InfiniteBench's passkey/number_string and RULER's
  ``noise`` haystack (both benchmarks use the same line).
- ``prose_words``: RULER's ``essay`` haystack. RULER uses Paul Graham's essays; we use the
  public-domain prose corpus shipped in :mod:`tokenselect.data` (never repeated filler).
- ``random_key_word``, ``plain_words``: RULER's needle keys are wonderwords ``adjective-noun`` pairs;
  cwe draws from wonderwords' nouns, adjectives and verbs (the ``wonderwords`` package, MIT licence).
"""

from __future__ import annotations

import functools
import random
import re
import uuid
from importlib.resources import files

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."


@functools.lru_cache(maxsize=1)
def prose_words() -> list[str]:
    """The prose corpus as one list of words, whitespace collapsed as RULER does with its essays."""
    from tokenselect.data import prose_text

    return re.sub(r"\s+", " ", prose_text()).strip().split(" ")


def prose_slice(n_words: int, start: int) -> str:
    """``n_words`` consecutive words of the corpus from ``start``, wrapping round at its end."""
    words = prose_words()
    start %= len(words)
    out = words[start:start + n_words]
    while len(out) < n_words:
        out += words[: n_words - len(out)]
    return " ".join(out)


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text`` (a split after ., ! or ? followed by a space; RULER uses nltk's punkt)."""
    return [s for s in re.split(r"(?<=[.!?])\s+", text.strip()) if s]


@functools.lru_cache(maxsize=None)
def _wonderwords(name: str) -> tuple[str, ...]:
    text = files("wonderwords").joinpath("assets", name).read_text(encoding="utf-8")
    return tuple(line.strip() for line in text.splitlines() if line.strip())


def random_key_word(rng: random.Random) -> str:
    """A RULER needle key word: a uniform ``adjective-noun`` pair of wonderwords' lists."""
    return f"{rng.choice(_wonderwords('adjectivelist.txt'))}-{rng.choice(_wonderwords('nounlist.txt'))}"


@functools.lru_cache(maxsize=1)
def plain_words() -> list[str]:
    """RULER cwe's vocabulary: wonderwords nouns, adjectives and verbs, sorted and de-duplicated."""
    return sorted(set(_wonderwords("nounlist.txt") + _wonderwords("adjectivelist.txt")
                      + _wonderwords("verblist.txt")))


def random_number(rng: random.Random, digits: int = 7) -> str:
    """A ``digits``-digit number with no leading zero (RULER's ``numbers`` needles)."""
    return str(rng.randint(10 ** (digits - 1), 10 ** digits - 1))


def random_uuid(rng: random.Random) -> str:
    """A version-4 UUID string drawn from ``rng``."""
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def random_value(kind: str, rng: random.Random) -> str:
    """A RULER needle key or value: ``numbers``, ``words`` or ``uuids``."""
    draw = {"numbers": random_number, "words": random_key_word, "uuids": random_uuid}.get(kind)
    if draw is None:
        raise ValueError(f"unknown needle type {kind!r}")
    return draw(rng)

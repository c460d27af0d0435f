"""InfiniteBench retrieval tasks: passkey, number_string, kv_retrieval.

Contexts as ``data/construct_synthetic_dataset.py`` of OpenBMB/InfiniteBench builds them, prompts as
``src/prompt.py`` words them for open base models (the ``yarn_mistral`` templates, which end with an
answer prefix for passkey and number_string). The haystack size n counts noise lines (passkey,
number_string) or JSON key-value pairs (kv_retrieval); the needle sits at line/pair round(depth * n).
"""

from __future__ import annotations

import random

from .base import Sample
from .haystack import NOISE, random_uuid

PASSKEY_TEMPLATE = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                    "I will quiz you about the important information.\n\n{context}\n\n{input}")
PASSKEY_PREFIX = "\n\nThe pass key is"
NUMBER_STRING_TEMPLATE = ("There is an important info hidden inside a lot of irrelevant text. Find it. "
                          "I will quiz you about the important information there.\n\n{context}\n\n{input}")
NUMBER_STRING_PREFIX = "\n\nThe sequence of digits is"
KV_TEMPLATE = "Extract the value corresponding to the specified key in the JSON object below.\n\n{context}\n\n{input}"


def _noise_context(n: int, depth: float, needle: str) -> str:
    before = round(depth * n)
    return (NOISE + "\n") * before + needle + (NOISE + "\n") * (n - before)


def passkey(n: int, depth: float, rng: random.Random, length_tokens: int) -> Sample:
    """A 5-digit pass key (each digit uniform 0-9) in n lines of noise."""
    key = "".join(str(rng.randint(0, 9)) for _ in range(5))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key.\n"
    prompt = PASSKEY_TEMPLATE.format(context=_noise_context(n, depth, needle), input="What is the pass key?")
    return Sample(prompt + PASSKEY_PREFIX, [key], PASSKEY_PREFIX)


def number_string(n: int, depth: float, rng: random.Random, length_tokens: int) -> Sample:
    """A 10-digit string: 5 random digits, then 5 times one of them doubled in place."""
    digits = [str(rng.randint(0, 9)) for _ in range(5)]
    for k in range(5):
        pos = rng.randint(0, 5 + k - 1)
        digits.insert(pos, digits[pos])
    key = "".join(digits)
    needle = f"The sequence of digits is {key}. Remember it. {key} is the sequence of digits.\n"
    prompt = NUMBER_STRING_TEMPLATE.format(context=_noise_context(n, depth, needle),
                                           input="What is the sequence of digits?")
    return Sample(prompt + NUMBER_STRING_PREFIX, [key], NUMBER_STRING_PREFIX)


def kv_retrieval(n: int, depth: float, rng: random.Random, length_tokens: int) -> Sample:
    """A JSON object of n UUID -> UUID pairs; retrieve the value of the pair at the given depth."""
    pairs = [(random_uuid(rng), random_uuid(rng)) for _ in range(n)]
    key, value = pairs[min(round(depth * n), n - 1)]
    context = "JSON data:\n{" + ", ".join(f'"{k}": "{v}"' for k, v in pairs) + "}"
    question = f'\nKey: "{key}"\nThe value associated with the specified key is: '
    return Sample(KV_TEMPLATE.format(context=context, input=question), [value])

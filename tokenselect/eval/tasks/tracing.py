"""RULER variable tracking, ``vt`` (``scripts/data/synthetic/variable_tracking.py``; synthetic.yaml:
noise haystack, 1 chain of 4 hops, with RULER's one-shot example in front).

A chain "VAR AAAAA = 12345", "VAR BBBBB = VAR AAAAA ", ... hides among n noise lines at random
places (in order); the answer is every variable of the chain. Depth does not apply.
"""

from __future__ import annotations

import random
import string

from .base import Sample
from .haystack import NOISE

TEMPLATE = ("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
            "Question: Find all variables that are assigned the value {query} in the text above.")
ANSWER_PREFIX = (" Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
                 "are assigned the value {query}, they are: ")
NUM_HOPS = 4
EXAMPLE_NOISE_LINES = 10


def _chain_prompt(n_noise: int, var_len: int, rng: random.Random) -> tuple[str, str, list[str]]:
    """(prompt without answer prefix, answer prefix, chain variables) for one chain in n_noise lines."""
    names: list[str] = []
    while len(names) < NUM_HOPS + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=var_len))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(NUM_HOPS)]
    lines = [NOISE] * n_noise
    positions = sorted(rng.sample(range(n_noise), len(chain))) if n_noise >= len(chain) else [0] * len(chain)
    for j, (pos, statement) in enumerate(zip(positions, chain)):
        lines.insert(pos + j, statement)
    context = "\n".join(lines).replace(". \n", ".\n")
    prefix = ANSWER_PREFIX.format(num_v=NUM_HOPS + 1, query=value)
    return TEMPLATE.format(context=context, query=value), prefix, names


def vt(n: int, depth: float, rng: random.Random, length_tokens: int) -> Sample:
    """One-shot example (3-letter variables) then the question over n noise lines (5-letter variables)."""
    ex_prompt, ex_prefix, ex_names = _chain_prompt(EXAMPLE_NOISE_LINES, 3, rng)
    example = ex_prompt + ex_prefix + " " + " ".join(ex_names) + "\n"
    prompt, prefix, names = _chain_prompt(n, 5, rng)
    return Sample(example + "\n" + prompt + prefix, names, prefix)

"""RULER aggregation tasks: common words ``cwe`` and frequent coded words ``fwe``
(``scripts/data/synthetic/common_words_extraction.py`` and ``freq_words_extraction.py``). Depth does not apply.
"""

from __future__ import annotations

import math
import random
import string

from .base import Sample
from .haystack import plain_words

CWE_TEMPLATE = ("Below is a numbered list of words. In these words, some appear more often than others. "
                "Memorize the ones that appear most often.\n{context}\n"
                "Question: What are the 10 most common words in the above list?")
CWE_PREFIX = " Answer: The top 10 words that appear most often in the list are:"
NUM_COMMON = 10
SHORT = 4096  # below this target length RULER uses fewer repeats

FWE_TEMPLATE = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
                "the dots '....'. What are the three most frequently appeared words in the above coded text?")
FWE_PREFIX = " Answer: According to the coded text above, the three most frequently appeared words are:"
FWE_ALPHA = 2.0
ZETA_2 = math.pi ** 2 / 6  # Riemann zeta(2), the normaliser of the Zipf(2) counts
CODED_WORD_LEN = 6


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


def _word_list(num_words: int, common_repeats: int, uncommon_repeats: int,
               rng: random.Random) -> tuple[str, list[str]]:
    chosen = rng.sample(plain_words(), num_words)
    common, uncommon = chosen[:NUM_COMMON], chosen[NUM_COMMON:]
    listing = common * common_repeats + uncommon * uncommon_repeats
    rng.shuffle(listing)
    return _numbered(listing), common


def cwe(n: int, depth: float, rng: random.Random, length_tokens: int) -> Sample:
    """10 common words among n uncommon ones (repeats 30/3, or 6/1 below 4K), after a one-shot example."""
    short = length_tokens < SHORT
    ex_context, ex_answer = _word_list(20 if short else 40, 3 if short else 10, 1 if short else 3, rng)
    example = CWE_TEMPLATE.format(context=ex_context) + CWE_PREFIX + " " + _numbered(ex_answer)
    context, answer = _word_list(NUM_COMMON + n, 6 if short else 30, 1 if short else 3, rng)
    return Sample(example + "\n" + CWE_TEMPLATE.format(context=context) + CWE_PREFIX, answer, CWE_PREFIX)


def fwe(n: int, depth: float, rng: random.Random, length_tokens: int) -> Sample:
    """n coded words drawn with Zipf(2) counts from a vocabulary of length_tokens // 50 words; the most
    frequent one is the noise '...', the answer is the next three."""
    vocab_size = max(length_tokens // 50, 4)
    vocab: set[str] = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=CODED_WORD_LEN)))
    ranked = sorted(vocab)
    rng.shuffle(ranked)
    ranked[0] = "..."
    text = [word for k, word in enumerate(ranked, 1) for _ in range(int(n * k ** -FWE_ALPHA / ZETA_2))]
    rng.shuffle(text)
    return Sample(FWE_TEMPLATE.format(context=" ".join(text)) + FWE_PREFIX, ranked[1:4], FWE_PREFIX)

"""Retrieval drills in the formats of the evaluation tasks, sized in tokens.

Written here because `tokenselect/eval/tasks.py` did not exist when the default model was
trained. Wording follows InfiniteBench (passkey, number_string, kv_retrieval) and RULER
(niah single needle). Every generator takes a target length in tokens, a needle depth in
[0, 1], a `random.Random`, and `count_tokens(str) -> int`, and returns a `Drill` whose
prompt plus answer fits within the target length.
"""
import json
import uuid
from dataclasses import dataclass, field

TASKS = ("passkey", "number_string", "kv_retrieval", "needle")

IB_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
IB_PREFIX = ("There is an important info hidden inside a lot of irrelevant text. "
             "Find it and memorize them. I will quiz you about the important information there.")


@dataclass
class Drill:
    input: str
    answers: list
    meta: dict = field(default_factory=dict)

    def text(self) -> str:
        return self.input + self.answers[0]


def _fill(head, units, needle, tail, target, depth, count_tokens, sep=" "):
    """head + units[:k] with `needle` inserted at fraction `depth` + tail, as long as fits `target`."""
    fixed = count_tokens(head + sep + needle + sep + tail)
    budget = max(0, target - fixed)
    per = [count_tokens(sep + u) for u in units[:4]] or [1]
    unit_cost = max(1, sum(per) / len(per))
    k = max(0, int(budget / unit_cost))
    while True:
        chosen = [units[i % len(units)] for i in range(k)]
        pos = int(round(depth * k))
        body = chosen[:pos] + [needle] + chosen[pos:]
        text = head + sep + sep.join(body) + sep + tail
        if k == 0 or count_tokens(text) <= target:
            return text
        k = max(0, k - max(1, k // 20))


def passkey(target, depth, rng, count_tokens):
    key = str(rng.randint(10000, 99999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."
    answer = " " + key
    tail = "What is the pass key? The pass key is"
    text = _fill(IB_PREFIX, [IB_NOISE], needle, tail, target - count_tokens(answer) - 1, depth, count_tokens)
    return Drill(text, [answer], {"task": "passkey", "depth": depth})


def number_string(target, depth, rng, count_tokens):
    digits = "".join(str(rng.randint(0, 9)) for _ in range(10))
    needle = f"The sequence of digits is {digits}. Remember it. {digits} is the sequence of digits."
    answer = " " + digits
    tail = "What is the sequence of digits? The sequence of digits is"
    text = _fill(IB_PREFIX, [IB_NOISE], needle, tail, target - count_tokens(answer) - 1, depth, count_tokens)
    return Drill(text, [answer], {"task": "number_string", "depth": depth})


def _uuid(rng):
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def kv_retrieval(target, depth, rng, count_tokens):
    head = "Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n"
    key, value = _uuid(rng), _uuid(rng)
    answer = " " + value
    pair_cost = count_tokens(json.dumps({_uuid(rng): _uuid(rng)})) - 1
    budget = target - count_tokens(answer) - 1
    n = max(1, int((budget - 60) / pair_cost))
    while True:
        pairs = [(_uuid(rng), _uuid(rng)) for _ in range(n - 1)]
        pairs.insert(int(round(depth * (n - 1))), (key, value))
        data = json.dumps(dict(pairs), indent=1)
        text = (head + data + f"\n\nKey: \"{key}\"\n"
                "The value associated with the specified key is:")
        if n == 1 or count_tokens(text) <= budget:
            return Drill(text, [answer], {"task": "kv_retrieval", "depth": depth, "pairs": n})
        n -= max(1, n // 10)


def needle(target, depth, rng, count_tokens, haystack_sentences=None):
    """RULER niah_single style: a 7-digit magic number for a word key, in noise or real text."""
    words = ["apple", "river", "lantern", "falcon", "marble", "violet", "harbor", "meadow",
             "copper", "orchid", "thunder", "velvet", "glacier", "saffron", "compass", "ember"]
    key = f"{rng.choice(words)}-{rng.choice(words)}"
    value = str(rng.randint(1000000, 9999999))
    head = ("Some special magic numbers are hidden within the following text. Make sure to memorize it. "
            "I will quiz you about the numbers afterwards.\n")
    nd = f"One of the special magic numbers for {key} is: {value}."
    tail = (f"\nWhat is the special magic number for {key} mentioned in the provided text? "
            f"The special magic number for {key} mentioned in the provided text is")
    answer = " " + value
    if haystack_sentences:
        start = rng.randrange(len(haystack_sentences))
        units = haystack_sentences[start:start + 400] or haystack_sentences[:400]
    else:
        units = [IB_NOISE]
    text = _fill(head, units, nd, tail, target - count_tokens(answer) - 1, depth, count_tokens)
    return Drill(text, [answer], {"task": "needle", "depth": depth})


GENERATORS = {"passkey": passkey, "number_string": number_string,
              "kv_retrieval": kv_retrieval, "needle": needle}

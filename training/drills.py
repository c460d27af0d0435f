"""Training drills made by the evaluation's own task generators, with the answer written out.

A drill is one sample of ``tokenselect.eval.tasks.make_sample`` (the very prompts ``tokenselect
eval`` scores, templates and haystacks included; nothing is copied here) followed by a completion:
the answer as the evaluation reads it, then the end-of-sequence token, so that the model learns both
what to answer and where to stop.

Drill ``n`` is fully determined by ``n``: its task, length, depth and sample all come from
``random.Random(f"train/{n}")``. The evaluation seeds its samples with
``random.Random(f"{seed}/{task}/{tokens}/{i}")`` (``seed`` an integer), the training script's own
validation with ``random.Random(f"val/...")``: the three seed spaces never meet.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field

from tokenselect.eval.tasks import make_sample

# task -> relative frequency among the drills. The six core retrieval tasks of the eval table, plus
# three cheap RULER variants (several keys, several values, variable tracking).
TASK_WEIGHTS = {
    "passkey": 1.0,
    "number_string": 1.0,
    "kv_retrieval": 1.5,
    "niah_single_1": 1.0,
    "niah_single_2": 1.0,
    "niah_single_3": 1.0,
    "niah_multikey_1": 0.5,
    "niah_multivalue": 0.5,
    "vt": 0.5,
}
TASKS = tuple(TASK_WEIGHTS)
MIN_TOKENS = 128          # shortest drill (prompt + completion + end of sequence), in tokens
# tokens kept free for the completion and </s> when sizing the prompt (upper bounds, checked anyway)
RESERVE = {"kv_retrieval": 40, "niah_single_3": 40, "niah_multivalue": 48, "vt": 40}
DEFAULT_RESERVE = 16


@dataclass
class Drill:
    task: str
    prompt: str           # make_sample(...).input: ends with the task's answer prefix
    completion: str       # what the model should write after the prompt, before </s>
    answers: list
    meta: dict = field(default_factory=dict)


def _in_order_of_appearance(text: str, values: list[str]) -> list[str]:
    """``values`` sorted by where they first occur in ``text`` (the order the needles were read in)."""
    return sorted(values, key=lambda v: (text.find(v) if v in text else len(text)))


def _join_list(items: list[str]) -> str:
    if len(items) == 1:
        return items[0]
    if len(items) == 2:
        return f"{items[0]} and {items[1]}"
    return ", ".join(items[:-1]) + ", and " + items[-1]


def completion(task: str, sample) -> str:
    """The answer written the way the evaluation's scorer reads it (``tokenselect.eval.metrics``):

    - passkey, number_string (InfiniteBench: the first run of digits must equal the answer): the
      prompt ends "... is", so " 12345."; the full stop ends the digit run.
    - kv_retrieval (InfiniteBench: the value must be a word once ``: " ' . , ? ! { }`` are spaces):
      the prompt ends "is: ", so the bare UUID.
    - niah_* (RULER string_match_all: every reference must appear in the prediction): " 1234567." or,
      for several values, " A, B, C, and D." in the order the needles stand in the context.
    - vt (RULER string_match_all): the chain's variables in chain order, after one more space, as the
      one-shot example inside the prompt writes them.
    """
    answers = list(sample.answers)
    if task in ("passkey", "number_string"):
        return f" {answers[0]}."
    if task == "kv_retrieval":
        return answers[0]
    if task == "vt":
        return " " + " ".join(answers)
    if task.startswith("niah_"):
        if len(answers) > 1:
            answers = _in_order_of_appearance(sample.question, answers)
        return " " + _join_list(answers) + "."
    raise ValueError(f"no completion format for task {task!r}")


def make_drill(n: int, count_tokens, window: int = 1024, tasks=None) -> Drill:
    """Drill number ``n``: a task drawn by TASK_WEIGHTS (or uniformly from ``tasks``), a total length
    uniform in [MIN_TOKENS, window] tokens (prompt + completion + </s>, as counted by
    ``count_tokens``, which includes the tokenizer's <s>) and a needle depth uniform in [0, 1]."""
    rng = random.Random(f"train/{n}")
    names = list(tasks) if tasks else list(TASKS)
    weights = [TASK_WEIGHTS.get(t, 1.0) for t in names]
    task = rng.choices(names, weights)[0]
    total = rng.randint(MIN_TOKENS, window)
    depth = rng.random()
    reserve = RESERVE.get(task, DEFAULT_RESERVE)
    target = total - reserve
    for _ in range(12):
        try:
            # make_sample draws one number from its rng: a fresh one per attempt keeps drill n fixed
            sample = make_sample(task, target, depth, random.Random(f"train/{n}/sample"), count_tokens)
        except ValueError:  # too short for this task's smallest haystack (vt needs a few hundred tokens)
            target = min(window - reserve, target + 96)
            continue
        text = completion(task, sample)
        used = count_tokens(sample.input) + count_tokens(text) - count_tokens("") + 1  # + </s>
        if used <= window:
            return Drill(task, sample.input, text, list(sample.answers),
                         {"n": n, "depth": depth, "target_tokens": total, "tokens": used})
        target -= used - window
    raise RuntimeError(f"could not fit drill {n} ({task}) in {window} tokens")

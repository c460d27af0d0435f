"""Task generators: exact benchmark templates and answers, length targeting, depth, reproducibility."""

from __future__ import annotations

import json
import random
import re
from collections import Counter

import pytest

from tokenselect.data import prose_text
from tokenselect.eval.tasks import TASKS, make_sample
from tokenselect.eval.tasks.haystack import NOISE
from tokenselect.eval.tasks.infinitebench import kv_retrieval, number_string, passkey
from tokenselect.eval.tasks.niah import CONFIGS, build, prompt_template


def count_words(text: str) -> int:
    """A stand-in tokenizer: one token per whitespace-separated word."""
    return len(text.split())


def sample(task: str, length: int = 2000, depth: float = 0.5, seed: int = 0):
    return make_sample(task, length, depth, random.Random(seed), count_words)


# ---- InfiniteBench: construct_synthetic_dataset.py contexts, src/prompt.py (yarn_mistral) templates ----

def test_passkey_prompt_is_exactly_infinitebench():
    s = passkey(2, 0.5, random.Random(0), 0)
    key = s.answers[0]
    assert re.fullmatch(r"\d{5}", key)
    noise = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"
    assert s.input == ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                       "I will quiz you about the important information.\n\n"
                       + noise + f"The pass key is {key}. Remember it. {key} is the pass key.\n" + noise
                       + "\n\nWhat is the pass key?\n\nThe pass key is")
    assert s.answer_prefix == "\n\nThe pass key is" and s.input.endswith(s.answer_prefix)


def test_number_string_prompt_and_doubled_digits():
    s = number_string(3, 1.0, random.Random(1), 0)
    key = s.answers[0]
    assert re.fullmatch(r"\d{10}", key)
    # five digits, each insertion doubling one in place: at least five equal neighbours
    assert sum(a == b for a, b in zip(key, key[1:])) >= 5
    assert s.input == ("There is an important info hidden inside a lot of irrelevant text. Find it. I will quiz you "
                       "about the important information there.\n\n" + (NOISE + "\n") * 3
                       + f"The sequence of digits is {key}. Remember it. {key} is the sequence of digits.\n"
                       + "\n\nWhat is the sequence of digits?\n\nThe sequence of digits is")


@pytest.mark.parametrize("depth,index", [(0.0, 0), (0.5, 2), (1.0, 3)])
def test_kv_retrieval_is_a_flat_json_of_uuids(depth, index):
    s = kv_retrieval(4, depth, random.Random(2), 0)
    head = "Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n"
    assert s.input.startswith(head)
    body, question = s.input[len(head):].split("\n\n\nKey: ")
    pairs = list(json.loads(body).items())
    assert len(pairs) == 4 and body.startswith('{"') and '", "' in body  # one line, ", " between pairs
    key, value = pairs[index]
    assert question == f'"{key}"\nThe value associated with the specified key is: '
    assert s.answers == [value] and re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}",
                                                  value)
    assert s.answer_prefix == ""


# ---- RULER: scripts/data/synthetic/constants.py templates, niah.py needles, synthetic.yaml configs ----

def test_niah_templates_singular_and_plural_as_ruler_edits_them():
    template, prefix, type_v = prompt_template(CONFIGS["niah_single_1"])
    assert type_v == "number"
    assert template.format(type_needle_v=type_v, context="C", query="Q") == (
        "A special magic number is hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the number afterwards.\nC\nWhat is the special magic number for Q mentioned in the "
        "provided text?")
    assert prefix.format(type_needle_v=type_v, query="Q") == (
        " The special magic number for Q mentioned in the provided text is")
    template, prefix, type_v = prompt_template(CONFIGS["niah_multivalue"])
    assert template.format(type_needle_v=type_v, context="C", query="Q") == (
        "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the numbers afterwards.\nC\nWhat are all the special magic numbers for Q mentioned in "
        "the provided text?")
    assert prefix.format(type_needle_v=type_v, query="Q") == (
        " The special magic numbers for Q mentioned in the provided text are")


def test_niah_single_1_exact_prompt_in_noise_lines():
    s = build(CONFIGS["niah_single_1"], 2, 1.0, random.Random(3))
    (value,) = s.answers
    key = re.search(r"for (\S+) is: ", s.input).group(1)
    assert re.fullmatch(r"[a-z]+(-[a-z]+)*-[a-z]+", key) and re.fullmatch(r"\d{7}", value)
    assert s.input == ("A special magic number is hidden within the following text. Make sure to memorize it. I will "
                       f"quiz you about the number afterwards.\n{NOISE}\n{NOISE}\n"
                       f"One of the special magic numbers for {key} is: {value}.\n"
                       f"What is the special magic number for {key} mentioned in the provided text? "
                       f"The special magic number for {key} mentioned in the provided text is")


@pytest.mark.parametrize("task", list(CONFIGS))
def test_niah_needles_and_answers(task):
    cfg = CONFIGS[task]
    s = sample(task, 3000)
    value = r"\d{7}" if cfg.type_v == "numbers" else r"[0-9a-f-]{36}"
    needles = re.findall(rf"One of the special magic {cfg.type_v} for (\S+) is: ({value})\.", s.input)
    assert len(s.answers) == cfg.num_v * cfg.num_q
    for answer in s.answers:
        assert answer in [v for _, v in needles]
    question = s.input[s.input.rindex("\n") + 1:]
    queried = {k for k, v in needles if v in s.answers}
    assert all(k in question for k in queried)
    if cfg.haystack == "needle":
        assert len(needles) == s.meta["haystack_units"] + 1
    else:
        assert len(needles) == max(cfg.num_k, cfg.num_q) * cfg.num_v
    if cfg.num_q > 1:
        assert re.search(r"for \S+, \S+, \S+, and \S+ mentioned", question)


def test_essay_haystack_is_real_prose_never_noise():
    s = sample("niah_single_2", 3000)
    assert NOISE not in s.input
    sentences = [x for x in re.split(r"(?<=[.!?]) ", s.input) if len(x) > 40 and "special magic" not in x]
    corpus = " ".join(prose_text().split())
    assert len(sentences) > 20 and all(x in corpus for x in sentences[1:-1])
    assert len(set(sentences)) == len(sentences)


def test_depth_moves_the_needle():
    positions = []
    for depth in (0.0, 0.5, 1.0):
        s = sample("niah_single_2", 3000, depth)
        positions.append(s.input.index("One of the special magic") / len(s.input))
    assert positions[0] < 0.05 and 0.4 < positions[1] < 0.6 and positions[2] > 0.9
    s = sample("passkey", 2000, 0.0)
    assert s.input.index("The pass key is") < s.input.index(NOISE)


def test_vt_chain_in_order_with_one_shot_example():
    s = sample("vt", 2000)
    assert len(s.answers) == 5
    value = re.search(rf"VAR {s.answers[0]} = (\d{{5}})", s.input).group(1)
    question = s.input[s.input.rindex("Memorize and track"):]
    assert question.startswith("Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n")
    assert question.endswith(f"Question: Find all variables that are assigned the value {value} in the text above. "
                             "Answer: According to the chain(s) of variable assignment in the text above, 5 variables "
                             f"are assigned the value {value}, they are: ")
    places = [question.index(f"VAR {s.answers[0]} = {value}\n")]
    for a, b in zip(s.answers, s.answers[1:]):
        places.append(question.index(f"VAR {b} = VAR {a} \n") if f"VAR {b} = VAR {a} \n" in question
                      else question.index(f"VAR {b} = VAR {a} "))
    assert places == sorted(places)
    example = s.input[: s.input.rindex("Memorize and track")]
    assert example.startswith("Memorize and track") and re.search(r"they are:  [A-Z]{3}( [A-Z]{3}){4}\n\n$", example)
    # (two spaces: RULER joins the example's prefix, which ends in a space, and its answer with " ")


@pytest.mark.parametrize("length,repeats", [(2000, 6), (8000, 30)])
def test_cwe_answers_are_the_ten_most_common(length, repeats):
    s = sample("cwe", length)
    listing = s.input[s.input.rindex("most often.\n") + len("most often.\n"): s.input.rindex("\nQuestion:")]
    words = re.findall(r"\d+\. (\S+)", listing)
    counts = Counter(words)
    assert sorted(s.answers) == sorted(w for w, _ in counts.most_common(10))
    assert {counts[w] for w in s.answers} == {repeats}
    assert s.input.endswith(" Answer: The top 10 words that appear most often in the list are:")


def test_fwe_answers_are_the_three_most_frequent_coded_words():
    s = sample("fwe", 3000)
    text = s.input[s.input.index("coded words. ") + len("coded words. "): s.input.rindex("\nQuestion:")]
    counts = Counter(text.split())
    assert counts.most_common(1)[0][0] == "..."
    assert s.answers == [w for w, _ in counts.most_common(4)[1:]]
    assert all(re.fullmatch(r"[a-z]{6}", w) for w in s.answers)


# ---- sizing, seeds, errors ---------------------------------------------------------------------------

@pytest.mark.parametrize("task", list(TASKS))
def test_prompt_is_the_largest_that_fits(task):
    length = 3000
    s = make_sample(task, length, 0.3, random.Random(5), count_words)
    assert s.meta["tokens"] == count_words(s.input) <= length
    bigger = TASKS[task](s.meta["haystack_units"] + 1, 0.3, random.Random(s.meta["seed"]), length)
    assert count_words(bigger.input) > length


def test_length_in_model_tokens():
    from transformers import PreTrainedTokenizerFast

    from tokenselect.data import default_model_path

    tok = PreTrainedTokenizerFast(tokenizer_file=str(default_model_path() / "tokenizer.json"))
    count = lambda text: len(tok(text)["input_ids"])  # noqa: E731
    for task, length in [("passkey", 256), ("kv_retrieval", 512), ("niah_single_2", 1024), ("niah_single_3", 4096)]:
        tokens = count(make_sample(task, length, 0.5, random.Random(0), count).input)
        assert 0.9 * length <= tokens <= length


def test_same_seed_same_sample_other_seed_other_sample():
    for task in TASKS:
        a, b, c = (make_sample(task, 2000, 0.5, random.Random(seed), count_words) for seed in (1, 1, 2))
        assert (a.input, a.answers) == (b.input, b.answers)
        assert (a.input, a.answers) != (c.input, c.answers)


def test_errors():
    with pytest.raises(ValueError, match="unknown task"):
        sample("nope")
    with pytest.raises(ValueError, match="depth"):
        sample("passkey", depth=1.5)
    with pytest.raises(ValueError, match="too short"):
        sample("niah_single_1", 20)

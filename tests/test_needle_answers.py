"""benchmarks/needle_answers.py: each answer of a needle task read against the prompt the model saw."""

from __future__ import annotations

import json

from tokenselect.eval.runner import make_samples
from tokenselect.models.loader import Checkpoint

from benchmark_scripts import load


def test_each_answer_is_named_by_what_it_holds_of_the_prompt_s_needles(tiny_llama, tmp_path):
    """Prompts of niah_multikey_1 built as the eval builds them: every needle sentence is found (the asked one among
    them), and four made-up answers are counted as the right value, another needle's value, a needle's key, and
    none of them."""
    tool = load("needle_answers")
    checkpoint = Checkpoint(tiny_llama)
    cache = tmp_path / "prompts"
    cells = make_samples(checkpoint.tokenizer(), checkpoint.config.window, ["niah_multikey_1"], ["4x"], 2, 0, False,
                         cache)
    planted = [tool.needles(checkpoint.tokenizer().decode(c["prompt"])) for c in cells]
    for cell, found in zip(cells, planted):
        assert len(found) >= 2 and cell["answers"][0] in found.values()
    other = [(k, v) for k, v in planted[1].items() if v not in cells[1]["answers"]]
    rows = [("a", 0, f" {cells[0]['answers'][0]}."), ("a", 1, f" {other[0][1]}."), ("b", 0, f" {other[0][0]}"),
            ("b", 1, " The text does not say.")]
    rows = [{"policy": p, "task": "niah_multikey_1", "length": "4x", "sample": s, "answers": cells[s]["answers"],
             "prediction": text, "score": 0.0} for p, s, text in rows]
    rows[2]["sample"] = 1  # b's key answer is read against sample 1's needles, whose key it is
    rows[2]["answers"] = cells[1]["answers"]
    predictions = tmp_path / "predictions.jsonl"
    predictions.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "answers.md"
    counts = tool.main([str(predictions), "--model", str(tiny_llama), "--task", "niah_multikey_1", "--lengths", "4x",
                        "--samples", "2", "--prompt-cache", str(cache), "--out", str(out)])
    assert counts == {"a 4x": {"right": 1, "another needle's value": 1},
                      "b 4x": {"a needle's key": 1, "no needle's key or value": 1}}
    assert "| a | 4x | 2 | 1 | 1 | 0 | 0 |" in out.read_text()


def test_a_prompt_without_the_needle_sentence_finds_none():
    tool = load("needle_answers")
    assert tool.needles("One of the special magic numbers for ugly-beret is: 1554024. SECOND LORD.") == {
        "ugly-beret": "1554024"}
    assert tool.needles("The special magic number for ugly-beret mentioned in the provided text is") == {}

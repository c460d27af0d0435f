"""benchmarks/paired_answers.py: two runs compared on the prompts both answered, with the exact sign test."""

from __future__ import annotations

import gzip
import json
from math import comb

import pytest

from benchmark_scripts import load


def lines(policy: str, scores: list[float], predictions: list[str], length: str = "4x") -> list[str]:
    return [json.dumps({"policy": policy, "task": "niah_single_1", "length": length, "sample": i, "score": s,
                        "prediction": p, "answers": ["7"]}) + "\n" for i, (s, p) in enumerate(zip(scores, predictions))]


def test_sign_test_is_the_exact_two_sided_binomial():
    paired = load("paired_answers")
    assert paired.sign_test(0, 0) == 1.0 and paired.sign_test(3, 3) == 1.0  # no discordant pair, an even split
    assert paired.sign_test(2, 0) == pytest.approx(0.5)  # 2 * (1/4)
    assert paired.sign_test(0, 6) == pytest.approx(2 / 64)
    assert paired.sign_test(1, 7) == pytest.approx(2 * (comb(8, 0) + comb(8, 1)) / 256)
    assert paired.sign_test(7, 1) == paired.sign_test(1, 7)


def test_cells_compare_the_samples_both_sides_answered(tmp_path):
    """A run folder against one policy of a gzipped table: the table's extra sample 4 and other policy are left
    out; a partial score (0.5) is not a right answer, on either side of a pair."""
    paired = load("paired_answers")
    table = tmp_path / "table.jsonl.gz"
    with gzip.open(table, "wt") as f:
        f.writelines(lines("tokenselect", [1, 1, 0, 0, 1], ["7", "7.", "x", "y", "7"]))
        f.writelines(lines("full", [0] * 5, ["x"] * 5))
    run = tmp_path / "run"
    run.mkdir()
    (run / "predictions.jsonl").write_text("".join(lines("tokenselect", [1, 0.5, 1, 0.5], ["7", "7 and", "7", "z"])))
    (row,) = paired.compare(paired.load(f"{table}:tokenselect"), paired.load(str(run)))
    assert row == {"task": "niah_single_1", "length": "4x", "samples": 4, "base": 50.0, "new": 75.0,
                   "same_prediction": 1, "base_only": 1, "new_only": 1, "p": 1.0}
    text = paired.markdown([row], "bf16", "fp8")
    assert "| niah_single_1 | 4x | 4 | 50.0 | 75.0 | 1 | 1 | 1 | 1.00 |" in text
    assert "All cells: 4 samples, the same prediction in 1; right only in bf16: 1, only in fp8: 1" in text


def test_a_file_of_several_policies_needs_one_named(tmp_path):
    paired = load("paired_answers")
    table = tmp_path / "table.jsonl"
    table.write_text("".join(lines("a", [1], ["7"]) + lines("b", [0], ["x"])))
    with pytest.raises(SystemExit, match="holds 2 policies"):
        paired.load(str(table))
    with pytest.raises(SystemExit, match="no lines of policy 'c'"):
        paired.load(f"{table}:c")

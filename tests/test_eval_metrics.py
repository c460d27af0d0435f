"""Scorers on hand-computed cases, as InfiniteBench (src/compute_scores.py) and RULER
(scripts/eval/synthetic/constants.py, scripts/eval/evaluate.py) define them."""

from __future__ import annotations

import pytest

from tokenselect.eval.metrics import (first_int, kv_retrieval_score, passkey_score, ruler_postprocess, score,
                                      string_match_all, string_match_part)


@pytest.mark.parametrize("prediction,expected", [
    (" 71432.", "71432"),
    ("The pass key is 71432. Remember it.", "71432"),
    ("key: 0071 then 55", "0071"),  # the first run of digits, leading zeros kept
    ("no digits", ""),
    ("3.14", "3"),
])
def test_first_int(prediction, expected):
    assert first_int(prediction) == expected


def test_passkey_and_number_string_take_the_first_number_only():
    assert passkey_score(" 71432. Remember it.", ["71432"]) == 1.0
    assert passkey_score(" 7143 2", ["71432"]) == 0.0  # split digits do not join
    assert passkey_score(" 1 is wrong, 71432 is right", ["71432"]) == 0.0
    assert passkey_score(" 714320", ["71432"]) == 0.0
    assert score("number_string", " 0088811884.", ["0088811884"]) == 1.0
    assert score("passkey", "", ["71432"]) == 0.0


def test_kv_retrieval_needs_the_value_as_a_whole_word():
    value = "bd3f2c1e-6a4b-4c8d-9e0f-123456789abc"
    assert kv_retrieval_score(f'"{value}"', [value]) == 1.0
    assert kv_retrieval_score(f"The value is: {value}.\nDone", [value]) == 1.0
    assert kv_retrieval_score(f"{{{value}}}", [value]) == 1.0
    assert kv_retrieval_score(f"{value}x", [value]) == 0.0
    assert kv_retrieval_score(value[:-1], [value]) == 0.0
    assert kv_retrieval_score(f"({value})", [value]) == 0.0  # parentheses are not separators in InfiniteBench


def test_string_match_all_is_the_fraction_of_references_found():
    refs = ["1234567", "Apple-Pie", "7654321", "x"]
    assert string_match_all("APPLE-pie: 1234567", refs) == 0.5
    assert string_match_all("1234567 7654321 apple-pie x", refs) == 1.0
    assert string_match_all("", refs) == 0.0
    assert string_match_part("nothing but apple-pie", refs) == 1.0
    assert string_match_part("nothing", refs) == 0.0


def test_ruler_postprocess_and_dispatch():
    assert ruler_postprocess("  a\tb\x00c \n") == "a\nb\nc"
    assert score("niah_multivalue", " 1111111, 2222222 and 3333333.", ["1111111", "2222222", "3333333", "4444444"]) == 0.75
    assert score("vt", " ABCDE FGHIJ", ["ABCDE", "FGHIJ"]) == 1.0
    assert score("cwe", "1. Dog 2. cat", ["dog", "cat", "owl", "ant"]) == 0.5
    with pytest.raises(ValueError, match="unknown task"):
        score("nope", "x", ["x"])

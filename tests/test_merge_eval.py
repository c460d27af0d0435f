"""benchmarks/merge_eval.py: runs of one policy each, or of different lengths, merged into one table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmark_scripts import load


def load_merge():
    return load("merge_eval").main


def write_run(folder: Path, policy: str, length: str, scores: list[float], hits: int = 0, misses: int = 0,
              answers: str = "7") -> Path:
    """A run folder as `tokenselect eval` writes it: one task, one length, one sample per score."""
    folder.mkdir(parents=True)
    rows = [{"policy": policy, "task": "niah_single_1", "length": length, "target_tokens": 8192 * int(length[:-1]),
             "prompt_tokens": 100, "sample": i, "depth": i / max(1, len(scores) - 1), "answers": [answers],
             "prediction": "x", "score": s, "prefill_s": 0.1, "decode_s": 0.2} for i, s in enumerate(scores)]
    (folder / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cache = {policy: {"hits": hits, "misses": misses, "hit_rate": hits / max(1, hits + misses)}} if hits + misses else {}
    (folder / "summary.json").write_text(json.dumps({"config": {"attention": policy}, "selection_cache": cache}))
    (folder / "table.md").write_text("# Eval: test model\n\n| table |\n")
    return folder


def test_runs_of_different_lengths_combine_into_rows_in_length_order(tmp_path):
    merge = load_merge()
    a = write_run(tmp_path / "a", "tokenselect", "16x", [1.0, 0.0], hits=1, misses=3)
    b = write_run(tmp_path / "b", "tokenselect", "2x", [1.0, 1.0], hits=3, misses=1)
    c = write_run(tmp_path / "c", "full", "2x", [0.0, 0.0])
    merge(str(tmp_path / "out"), str(a), str(b), str(c))
    table = (tmp_path / "out" / "table.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| niah_single_1")]
    assert [r.split("|")[2].strip() for r in rows] == ["2x", "16x"]  # by length, not by run order
    assert rows[0].split("|")[3].strip().startswith("100.0")  # tokenselect at 2x
    assert rows[1].split("|")[3].strip().startswith("50.0")
    assert rows[1].split("|")[4].strip() == "—"  # full was not run at 16x
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["selection_cache"]["tokenselect"] == {"hits": 4, "misses": 4, "hit_rate": 0.5}  # summed
    assert "Selection Cache of tokenselect: 50.0% hits (4 of 8" in table


def test_a_cell_from_two_runs_or_other_prompts_is_refused(tmp_path):
    merge = load_merge()
    a = write_run(tmp_path / "a", "tokenselect", "2x", [1.0])
    again = write_run(tmp_path / "again", "tokenselect", "2x", [1.0])
    with pytest.raises(SystemExit, match="repeats cells"):
        merge(str(tmp_path / "out"), str(a), str(again))
    other = write_run(tmp_path / "other", "full", "2x", [1.0], answers="8")
    with pytest.raises(SystemExit, match="other prompts"):
        merge(str(tmp_path / "out2"), str(a), str(other))


def test_a_run_stopped_early_merges_and_its_short_cells_are_named(tmp_path):
    """A run that kept 2 of its 4 samples shares them with a whole run of another policy: merged, its cell scored
    from the 2, and the table names the short cell; a short run whose samples disagree is still refused."""
    merge = load_merge()
    whole = write_run(tmp_path / "whole", "full", "2x", [1.0, 0.0, 0.0, 0.0])
    short = write_run(tmp_path / "short", "tokenselect", "2x", [1.0, 1.0])
    merge(str(tmp_path / "out"), str(whole), str(short))
    table = (tmp_path / "out" / "table.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| niah_single_1 | 2x"))
    assert [c.strip().split(" ")[0] for c in row.split("|")[3:5]] == ["25.0", "100.0"]
    assert "Cells with fewer than 4 samples (runs stopped early): tokenselect niah_single_1 2x: 2.\n" in table
    whole_only = tmp_path / "out_whole"
    merge(str(whole_only), str(whole))
    assert "fewer than" not in (whole_only / "table.md").read_text()
    other = write_run(tmp_path / "other", "infllm", "2x", [1.0], answers="8")
    with pytest.raises(SystemExit, match="other prompts"):
        merge(str(tmp_path / "out3"), str(whole), str(other))


def test_a_run_killed_before_its_summary_merges_from_its_predictions(tmp_path):
    """Only predictions.jsonl left (the process killed mid-run): its samples merge, the table names the run."""
    merge = load_merge()
    whole = write_run(tmp_path / "whole", "full", "2x", [1.0, 1.0, 0.0, 0.0])
    killed = write_run(tmp_path / "killed", "infllm", "2x", [0.0, 1.0, 1.0])
    (killed / "summary.json").unlink()
    (killed / "table.md").unlink()
    merge(str(tmp_path / "out"), str(whole), str(killed))
    table = (tmp_path / "out" / "table.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| niah_single_1 | 2x"))
    assert [c.strip().split(" ")[0] for c in row.split("|")[3:5]] == ["50.0", "66.7"]
    assert "Runs killed before their summary (their finished samples merged from predictions.jsonl; no Selection " \
           "Cache counts): killed (3 samples).\n" in table
    assert table.startswith("# Eval: test model\n")


def test_repeated_cells_need_the_flag_and_the_fuller_run_stands(tmp_path):
    """With --repeats a cell two runs answered comes from the run with more samples (the earlier on a tie), and the
    table counts the shared samples whose predictions agree; without it the repeat is refused."""
    merge = load_merge()
    short = write_run(tmp_path / "short", "full", "2x", [1.0, 0.0])
    whole = write_run(tmp_path / "whole", "full", "2x", [1.0, 1.0, 1.0])
    rows = [json.loads(line) for line in (whole / "predictions.jsonl").read_text().splitlines()]
    rows[1]["prediction"] = "y"  # sample 1 answered differently from the short run's
    (whole / "predictions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit, match="repeats cells"):
        merge(str(tmp_path / "refused"), str(short), str(whole))
    merge(str(tmp_path / "out"), str(short), str(whole), repeats=True)
    table = (tmp_path / "out" / "table.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| niah_single_1 | 2x"))
    assert row.split("|")[3].strip().startswith("100.0")  # the whole run's 3 samples, not the short run's 2
    assert "fewer than" not in table
    assert "Cells answered by more than one run (1; the run with more samples stands): the samples both answered " \
           "got the same prediction in 1 of 2.\n" in table
    tie = write_run(tmp_path / "tie", "full", "2x", [0.0, 0.0, 0.0])
    merge(str(tmp_path / "out_tie"), str(whole), str(tie), repeats=True)
    row = next(line for line in (tmp_path / "out_tie" / "table.md").read_text().splitlines()
               if line.startswith("| niah_single_1 | 2x"))
    assert row.split("|")[3].strip().startswith("100.0")  # a tie: the earlier run stands

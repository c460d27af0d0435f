"""benchmarks/seed_resume.py: an earlier table's answers seed a run's folder, and ``tokenselect eval --resume`` then
generates only the samples the table lacks."""

from __future__ import annotations

import gzip
import json

from tokenselect.cli import build_parser

from benchmark_scripts import load
from test_eval_cli import resume_argv


def run_eval(argv: list[str]) -> None:
    args = build_parser().parse_args(["eval", *argv])
    assert args.func(args) == 0


def records(folder) -> list[dict]:
    return [json.loads(line) for line in (folder / "predictions.jsonl").read_text().splitlines()]


def test_a_seeded_run_keeps_the_table_s_answers_and_generates_only_the_missing(tiny_llama, tmp_path, monkeypatch):
    from tokenselect.eval import runner

    seed = load("seed_resume").main
    table = tmp_path / "table"
    run_eval(resume_argv(tiny_llama, tmp_path, table))  # the committed table: 2 policies x 2 lengths x 3 samples
    whole = records(table)
    # the table lost tokenselect's last 512-token sample (a run stopped at its limit)
    short = [r for r in whole if not (r["policy"] == "tokenselect" and r["length"] == "512" and r["sample"] == 2)]
    packed = tmp_path / "predictions.jsonl.gz"
    with gzip.open(packed, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in short)
    topup = tmp_path / "topup"
    argv = [*resume_argv(tiny_llama, tmp_path, topup), "--attention", "tokenselect", "--lengths", "512"]
    assert seed([str(packed), "--", *argv]) == 0
    seeded = records(topup)
    assert [(r["policy"], r["length"], r["sample"]) for r in seeded] == [("tokenselect", "512", 0),
                                                                       ("tokenselect", "512", 1)]
    assert seed([str(packed), "--", *argv]) == 0 and records(topup) == seeded  # a folder with answers is left alone
    asked = []
    real = runner.generate_all
    monkeypatch.setattr(runner, "generate_all", lambda llm, cells, *a, **k: (asked.append(len(cells)),
                                                                             real(llm, cells, *a, **k))[1])
    run_eval([*argv, "--resume"])  # run.json from the same arguments: the resume accepts the seeded answers
    assert asked == [1]
    done = records(topup)
    assert len(done) == 3 and done[:2] == seeded  # the table's answers kept as they were, timings and all
    lost = next(r for r in whole if r["policy"] == "tokenselect" and r["length"] == "512" and r["sample"] == 2)
    assert {k: v for k, v in done[2].items() if not k.endswith("_s")} == {
        k: v for k, v in lost.items() if not k.endswith("_s")}  # the missing sample generated as the table had it


def test_usage_without_the_separator(tmp_path, capsys):
    seed = load("seed_resume").main
    assert seed([str(tmp_path / "p.jsonl"), "--model", "x"]) == 2
    assert "Seed an eval output folder" in capsys.readouterr().err

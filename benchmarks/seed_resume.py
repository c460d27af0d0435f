"""Seed an eval output folder with an earlier run's answers, so that ``tokenselect eval --resume`` tops a table's
cells up to their sample count instead of answering them all again.

    python benchmarks/seed_resume.py PREDICTIONS -- EVAL_ARGS...

PREDICTIONS: a ``predictions.jsonl`` (or ``.jsonl.gz``) holding the earlier answers, e.g. a merged table's
``supporting/*_predictions.jsonl.gz``. EVAL_ARGS: the very arguments of the ``tokenselect eval`` run to seed (its
``--output`` folder is the one written). The folder gets those of the earlier answers that belong to the run's cells
(its ``--attention``, ``--task`` and ``--lengths``) and a ``run.json`` of the run's own settings: the earlier runs
wrote none (they predate ``--resume``), so this states that their settings were the same, which the caller vouches
for (the table's model, chat mode, seed and samples). The eval itself still refuses an answer whose prompt differs
from the run's cell (``cell_index``: task, length, sample, depth, target tokens and answers).
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

from tokenselect.cli import build_parser
from tokenselect.eval.runner import run_settings


def parser() -> argparse.ArgumentParser:
    """The script's own arguments: what comes before the ``--`` (EVAL_ARGS after it are ``tokenselect eval``'s)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                usage="%(prog)s [-h] PREDICTIONS -- EVAL_ARGS...")
    p.add_argument("predictions", type=Path, metavar="PREDICTIONS",
                   help="a predictions.jsonl (or .jsonl.gz) of the earlier answers")
    return p


def main(argv: list[str]) -> int:
    p = parser()
    cut = argv.index("--") if "--" in argv else len(argv)
    ours, eval_args = argv[:cut], argv[cut + 1:]
    mine, stray = p.parse_known_args(ours)  # EVAL_ARGS given without the separator: stray, not an error of ours
    if stray or not eval_args:
        p.print_help(sys.stderr)
        return 2
    source = mine.predictions
    args = build_parser().parse_args(["eval", *eval_args])
    out = Path(args.output)
    if (out / "predictions.jsonl").exists():
        print(f"{out} already holds answers: not seeded again", file=sys.stderr)
        return 0
    policies, tasks, lengths = (set(value.split(",")) for value in (args.attention, args.task, args.lengths))
    opener = gzip.open if source.suffix == ".gz" else open
    with opener(source, "rt") as f:
        records = [json.loads(line) for line in f if line.strip()]
    kept = [r for r in records if r["policy"] in policies and r["task"] in tasks and r["length"] in lengths]
    out.mkdir(parents=True, exist_ok=True)
    (out / "run.json").write_text(json.dumps(run_settings(args), indent=2) + "\n")
    with open(out / "predictions.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in kept)
    print(f"{out}: {len(kept)} earlier answers of {len(records)} seeded")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

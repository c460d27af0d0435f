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

import gzip
import json
import sys
from pathlib import Path

from tokenselect.cli import build_parser
from tokenselect.eval.runner import run_settings


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    source = Path(argv[0])
    args = build_parser().parse_args(["eval", *argv[2:]])
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

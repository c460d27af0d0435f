"""Merge ``tokenselect eval`` runs of the same tasks, lengths and seed (e.g. one process per policy,
run side by side on one GPU) into one output folder: predictions, summary, table and plots.

    python benchmarks/merge_eval.py OUT RUN_DIR [RUN_DIR ...]

Columns come in the order of the RUN_DIRs. Every run must have answered the very same prompts.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenselect.eval.plots import plot_all
from tokenselect.eval.runner import markdown_table, summarize, write_outputs


def main(out: str, *runs: str) -> None:
    records, configs, cells = [], [], None
    for run in map(Path, runs):
        rows = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
        mine = sorted({(r["task"], r["length"], r["sample"], tuple(r["answers"])) for r in rows})
        if cells is not None and mine != cells:
            raise SystemExit(f"{run} answered other prompts than {runs[0]}: not mergeable")
        cells = mine
        records += rows
        configs.append(json.loads((run / "summary.json").read_text())["config"])
        title = (run / "table.md").read_text().splitlines()[0]
    scores = summarize(records)
    target = Path(out)
    write_outputs(records, scores, {"merged": [str(r) for r in runs], "configs": configs}, target)
    plot_all(records, target)
    table = markdown_table(scores)
    policies = ", ".join(dict.fromkeys(r["policy"] for r in records))
    (target / "table.md").write_text(f"{title}\n\n{table}\n\nPolicies {policies}: one `tokenselect eval` "
                                     f"process each, merged by `benchmarks/merge_eval.py`.\n")
    print(table)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    main(*sys.argv[1:])

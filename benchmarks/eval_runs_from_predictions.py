"""Turn a committed eval table back into runs that ``merge_eval.py`` merges: one folder per policy, holding that
policy's lines of the table's ``predictions.jsonl.gz`` and its Selection Cache counts from the table's JSON.

    python benchmarks/eval_runs_from_predictions.py TABLE.json PREDICTIONS.jsonl.gz OUTDIR

Writes OUTDIR/<policy>/ (``:;=@`` in a policy's name become ``_``) and prints each folder with its policy. A later
merge can then add new runs beside them, or name a column anew (``RUN_DIR=LABEL``: e.g. a column measured before a
default changed, named by the setting it ran with).
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from pathlib import Path


def main(table: str, predictions: str, out: str) -> None:
    summary = json.loads(Path(table).read_text())
    title = Path(table).with_suffix(".md").read_text().splitlines()[0]
    by_policy: dict[str, list[str]] = {}
    with gzip.open(predictions, "rt") as lines:
        for line in lines:
            by_policy.setdefault(json.loads(line)["policy"], []).append(line.rstrip("\n"))
    for policy, rows in by_policy.items():
        run = Path(out) / re.sub(r"[:;=@]", "_", policy)
        run.mkdir(parents=True, exist_ok=True)
        (run / "predictions.jsonl").write_text("\n".join(rows) + "\n")
        counts = summary.get("selection_cache", {}).get(policy)
        (run / "summary.json").write_text(json.dumps({"config": {"from": str(table), "policy": policy},
                                                      "selection_cache": {policy: counts} if counts else {}}))
        (run / "table.md").write_text(title + "\n")
        print(f"{run}\t{policy}\t{len(rows)} samples")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("table", metavar="TABLE.json", help="the committed eval table's JSON (its .md beside it)")
    parser.add_argument("predictions", metavar="PREDICTIONS.jsonl.gz", help="the table's predictions")
    parser.add_argument("out", metavar="OUTDIR", help="folder the runs are written to, one folder per policy")
    args = parser.parse_args()
    main(args.table, args.predictions, args.out)

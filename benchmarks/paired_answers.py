"""Compare two eval runs answer by answer, on the prompts both answered: one setting against another (e.g.
TokenSelect with fp8 selection keys against a table's `tokenselect` column). A table built from two separate runs
says whether scores moved; this says on which samples, and whether the change is more than chance.

    python benchmarks/paired_answers.py BASE NEW [--base-name NAME] [--new-name NAME] [--out FILE.md]

BASE and NEW are each `PATH[:POLICY]`: PATH a run folder (its predictions.jsonl), or a predictions.jsonl[.gz] file
(a committed table's); POLICY keeps only that policy's lines (needed where the file holds several). Per (task,
length) cell: samples both answered, each side's mean score, how many predictions are identical, the samples only
one side got right, and the two-sided exact sign test (McNemar) on those: the chance of a split at least that
uneven if neither side were better. A sample is "right" when its score is 1 (the needle tasks score 0 or 1; a task
with partial scores, vt, counts only whole answers here).
"""

from __future__ import annotations

import argparse
import gzip
import json
from math import comb
from pathlib import Path


def load(spec: str) -> dict[tuple[str, str, int], dict]:
    """`PATH[:POLICY]` -> {(task, length, sample): prediction line}."""
    path, _, policy = spec.partition(":")
    file = Path(path) / "predictions.jsonl" if Path(path).is_dir() else Path(path)
    opener = gzip.open if file.suffix == ".gz" else open
    with opener(file, "rt") as lines:
        rows = [json.loads(line) for line in lines if line.strip()]
    policies = {r["policy"] for r in rows}
    if not policy and len(policies) > 1:
        raise SystemExit(f"{file} holds {len(policies)} policies ({', '.join(sorted(policies))}): "
                         "name one, PATH:POLICY")
    kept = {(r["task"], r["length"], r["sample"]): r for r in rows if not policy or r["policy"] == policy}
    if not kept:
        raise SystemExit(f"{file}: no lines of policy {policy!r}")
    return kept


def sign_test(a: int, b: int) -> float:
    """Two-sided exact binomial test of a against b discordant pairs (McNemar's exact test): the chance of a split
    at least as uneven when each pair goes either way with probability 1/2."""
    n = a + b
    if n == 0:
        return 1.0
    tail = sum(comb(n, i) for i in range(min(a, b) + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def compare(base: dict, new: dict) -> list[dict]:
    """One row per (task, length) cell that both sides answered, in the base's order."""
    cells: dict[tuple[str, str], list] = {}
    for key in base:
        if key in new:
            cells.setdefault(key[:2], []).append(key)
    rows = []
    for (task, length), keys in cells.items():
        b = [base[k] for k in keys]
        n = [new[k] for k in keys]
        base_only = sum(x["score"] == 1 and y["score"] != 1 for x, y in zip(b, n))
        new_only = sum(y["score"] == 1 and x["score"] != 1 for x, y in zip(b, n))
        rows.append({"task": task, "length": length, "samples": len(keys),
                     "base": 100 * sum(x["score"] for x in b) / len(b),
                     "new": 100 * sum(y["score"] for y in n) / len(n),
                     "same_prediction": sum(x["prediction"] == y["prediction"] for x, y in zip(b, n)),
                     "base_only": base_only, "new_only": new_only, "p": sign_test(base_only, new_only)})
    return rows


def markdown(rows: list[dict], base: str, new: str) -> str:
    head = (f"| task | length | samples | {base} | {new} | same prediction | right only in {base} | "
            f"right only in {new} | sign test p |\n|---|---|---|---|---|---|---|---|---|\n")
    body = "".join(f"| {r['task']} | {r['length']} | {r['samples']} | {r['base']:.1f} | {r['new']:.1f} | "
                   f"{r['same_prediction']} | {r['base_only']} | {r['new_only']} | {r['p']:.2f} |\n" for r in rows)
    total = {k: sum(r[k] for r in rows) for k in ("samples", "same_prediction", "base_only", "new_only")}
    return (head + body + f"\nAll cells: {total['samples']} samples, the same prediction in "
            f"{total['same_prediction']}; right only in {base}: {total['base_only']}, only in {new}: "
            f"{total['new_only']} (sign test p = "
            f"{sign_test(total['base_only'], total['new_only']):.2f}).\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("base", help="PATH[:POLICY], the reference answers")
    parser.add_argument("new", help="PATH[:POLICY], the answers compared with them")
    parser.add_argument("--base-name", default="base", help="the base's column name")
    parser.add_argument("--new-name", default="new", help="the new side's column name")
    parser.add_argument("--out", help="also write the table to this file")
    args = parser.parse_args()
    rows = compare(load(args.base), load(args.new))
    if not rows:
        raise SystemExit("the two sides share no (task, length, sample)")
    text = markdown(rows, args.base_name, args.new_name)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()

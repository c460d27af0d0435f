"""Merge ``tokenselect eval`` runs of the same tasks, lengths and seed (e.g. one process per policy,
run side by side on one GPU) into one output folder: predictions, summary, table and plots.

    python benchmarks/merge_eval.py OUT RUN_DIR[=LABEL] [RUN_DIR[=LABEL] ...]

Columns come in the order of the RUN_DIRs. Runs may cover different (task, length) cells (e.g. a later run that
adds lengths); where two runs share a cell they must have answered the very same prompts, and each
(policy, task, length) cell comes from one run only. A run of one policy given a LABEL is that column's name (for
two runs of one policy under different engine settings). A run's Selection Cache counts are summed per column. A run
killed before it wrote its summary (only predictions.jsonl, a line per finished sample) merges from its
predictions, and the table names it.

    python benchmarks/merge_eval.py --repeats OUT RUN_DIR[=LABEL] ...

lets runs repeat cells (a column run whole again beside cells an older run holds): of a repeated cell the run with
more samples stands (the earlier one on a tie), and the table says how many of the samples both answered got the
same prediction (the prompts are the same; a difference is the code or the GPU between the runs). A run's Selection
Cache counts are summed whole, its cells that another run stands for included.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenselect.eval.plots import plot_all
from tokenselect.eval.runner import intervals, markdown_table, selection_cache_lines, summarize, write_outputs


def short_cells(records: list[dict]) -> str:
    """A line naming the cells with fewer samples than the fullest cell (a run stopped at its time limit keeps
    the samples it finished), or ''."""
    counts: dict = {}
    for r in records:
        key = (r["policy"], r["task"], r["length"])
        counts[key] = counts.get(key, 0) + 1
    full = max(counts.values(), default=0)
    short = [f"{p} {t} {n}: {c}" for (p, t, n), c in counts.items() if c < full]
    return f"\nCells with fewer than {full} samples (runs stopped early): {'; '.join(short)}.\n" if short else ""


def killed_line(killed: list[str]) -> str:
    """The note naming the runs killed before they wrote their summary (merged from predictions.jsonl, which grows
    a line per finished sample), or ''."""
    return (f"\nRuns killed before their summary (their finished samples merged from predictions.jsonl; no Selection "
            f"Cache counts): {', '.join(killed)}.\n" if killed else "")


def repeats_line(repeated: set, agree: int, shared: int) -> str:
    """The note on cells that more than one run answered (``--repeats``), or ''."""
    if not repeated:
        return ""
    return (f"\nCells answered by more than one run ({len(repeated)}; the run with more samples stands): the samples both "
            f"answered got the same prediction in {agree} of {shared}.\n")


def main(out: str, *runs: str, repeats: bool = False) -> None:
    title, killed = "", []
    configs, prompts, selection_cache = [], {}, {}
    cells: dict = {}  # (policy, task, length) -> the rows of the run that stands for it
    repeated: set = set()
    agree = shared = 0
    for spec in runs:
        path, _, label = spec.partition("=")
        run = Path(path)
        rows = [json.loads(line) for line in (run / "predictions.jsonl").read_text().splitlines()]
        if (run / "summary.json").is_file():
            summary = json.loads((run / "summary.json").read_text())
        else:  # killed before it wrote the rest: its finished samples stand, its Selection Cache counts are lost
            summary = {"config": {"killed": str(run)}, "selection_cache": {}}
            killed.append(f"{run.name} ({len(rows)} samples)")
        hit_rates = summary.get("selection_cache", {})
        if label:
            if len({r["policy"] for r in rows}) != 1:
                raise SystemExit(f"{run}: a LABEL names the column of a run of one policy")
            hit_rates = {label: counts for counts in hit_rates.values()}
            rows = [{**r, "policy": label} for r in rows]
        mine: dict = {}
        for r in rows:
            mine.setdefault((r["task"], r["length"]), {})[r["sample"]] = tuple(r["answers"])
        for cell, answered in mine.items():  # a run stopped early answered fewer samples, the same ones
            known = prompts.setdefault(cell, {})
            if any(known.get(sample, answers) != answers for sample, answers in answered.items()):
                raise SystemExit(f"{run} answered other prompts for {cell} than an earlier run: not mergeable")
            known.update(answered)
        by_cell: dict = {}
        for r in rows:
            by_cell.setdefault((r["policy"], r["task"], r["length"]), []).append(r)
        twice = sorted(set(cells) & set(by_cell))
        if twice and not repeats:
            raise SystemExit(f"{run} repeats cells of an earlier run: {twice[:3]} (--repeats allows it)")
        for cell, mine_rows in by_cell.items():
            if cell in cells:
                theirs = {r["sample"]: r["prediction"] for r in cells[cell]}
                both = [r for r in mine_rows if r["sample"] in theirs]
                shared += len(both)
                agree += sum(r["prediction"] == theirs[r["sample"]] for r in both)
                repeated.add(cell)
                if len(mine_rows) <= len(cells[cell]):
                    continue
            cells[cell] = mine_rows
        configs.append(summary["config"])
        for policy, counts in hit_rates.items():
            total = selection_cache.setdefault(policy, {"hits": 0, "misses": 0})
            total["hits"] += counts["hits"]
            total["misses"] += counts["misses"]
            total["hit_rate"] = round(total["hits"] / max(1, total["hits"] + total["misses"]), 4)
        if (run / "table.md").is_file():
            title = title or (run / "table.md").read_text().splitlines()[0]
    records = [r for rows in cells.values() for r in rows]
    scores = summarize(records)
    target = Path(out)
    write_outputs(records, scores, {"merged": [str(r) for r in runs], "configs": configs}, target, selection_cache)
    plot_all(records, target)
    table = markdown_table(scores, intervals(records))
    policies = ", ".join(dict.fromkeys(r["policy"] for r in records))
    (target / "table.md").write_text(f"{title}\n\n{table}\n\nPolicies {policies}: one `tokenselect eval` "
                                     f"process each, merged by `benchmarks/merge_eval.py`.\n"
                                     f"{short_cells(records)}{killed_line(killed)}{repeats_line(repeated, agree, shared)}"
                                     f"{selection_cache_lines(selection_cache)}")
    print(table)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", metavar="OUT", help="folder the merged predictions, summary, table and plots go to")
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR[=LABEL]",
                        help="a run's output folder, and the name of its column if given")
    parser.add_argument("--repeats", action="store_true",
                        help="let runs repeat cells (of a repeated cell the run with more samples stands)")
    args = parser.parse_intermixed_args()  # --repeats may stand anywhere among the runs
    main(args.out, *args.runs, repeats=args.repeats)

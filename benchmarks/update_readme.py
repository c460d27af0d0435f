"""Copy the committed benchmark and evaluation tables into README.md, between the results markers.

    python benchmarks/update_readme.py

Each table is the markdown file a benchmark or evaluation run wrote under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
START, END = "<!-- results:start -->", "<!-- results:end -->"
# the headline tables, in this order; the others follow by name
FIRST = ("eval_smollm2_h100", "real_model_checks_smollm2_h200", "real_model_checks_qwen2.5_coder_0.5b_h200",
         "e2e_best_dense_h200", "e2e_128k_h200", "e2e_h100", "attention_h200", "attention_h100")


def summary(md: Path) -> str:
    """The file's title and its first table (the notes and profiles stay in the file, linked)."""
    lines = md.read_text().splitlines()
    title = next((line.lstrip("# ") for line in lines if line.startswith("# ")), md.stem)
    start = next((i for i, line in enumerate(lines) if line.startswith("|")), None)
    if start is None:
        return ""
    end = next((i for i in range(start, len(lines)) if not lines[i].startswith("|")), len(lines))
    table = "\n".join(lines[start:end])
    return f"### {title}\n\n{table}\n\n_Full results and notes: [benchmarks/results/{md.name}](benchmarks/results/{md.name})._"


def results_section() -> str:
    files = sorted(RESULTS.glob("*.md"), key=lambda md: (FIRST.index(md.stem) if md.stem in FIRST else len(FIRST),
                                                          md.name))
    parts = [s for s in (summary(md) for md in files) if s]
    return "\n\n".join(parts) or "No results committed yet."


def main() -> None:
    readme = ROOT / "README.md"
    text = readme.read_text()
    block = f"{START}\n{results_section()}\n{END}"
    if START in text:
        text = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    else:
        text = text.replace("RESULTS_PLACEHOLDER", block)
    readme.write_text(text)


if __name__ == "__main__":
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    main()

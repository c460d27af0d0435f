"""Copy the committed benchmark and evaluation tables into README.md, between the results markers.

    python benchmarks/update_readme.py

Each table is the markdown file a benchmark or evaluation run wrote under benchmarks/results/.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
START, END = "<!-- results:start -->", "<!-- results:end -->"


def results_section() -> str:
    parts = []
    for md in sorted(RESULTS.glob("*.md")):
        body = md.read_text().strip()
        body = re.sub(r"^# ", "### ", body, flags=re.M)
        parts.append(f"{body}\n\n_Source: `benchmarks/results/{md.name}`._")
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
    main()

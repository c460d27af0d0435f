"""Time this tree's top-k (`tokenselect.kernels.topk`) against another version of the module on a GPU, in one
process: the same scores, the same CUDA-graph timing (``graph_us``: many calls a graph, as a decode step's layers
run them), after checking both pick the same positions. For a change to the radix select's passes (issue #28:
the launches of the vote's top-k in every layer of a step).

    python benchmarks/topk_passes_gpu.py OUTDIR OTHER_TOPK_PY   # e.g. .carry/before/tokenselect/kernels/topk.py

Writes OUTDIR/topk_passes.json and prints a table: microseconds a call at 128K and 1M scores, with every score
live (a selecting step) and none (a Selection Cache hit: the kernels return at once).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import tempfile
from pathlib import Path

import torch

from tokenselect.bench.attention import graph_us

this = importlib.import_module("tokenselect.kernels.topk")  # the module (the package exports a function)
K, CALLS, REPLAYS = 2048, 32, 20


def load_other(path: str):
    """The other topk.py as a module (its relative imports made absolute; Triton reads a kernel's source from its
    file, so the module is loaded from a copy on disk)."""
    source = Path(path).read_text().replace("from .operands import", "from tokenselect.kernels.operands import")
    copy = Path(tempfile.mkdtemp()) / "other_topk.py"
    copy.write_text(source)
    spec = importlib.util.spec_from_file_location("other_topk", copy)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(out: str, other_path: str) -> None:
    other = load_other(other_path)
    rows = []
    for n in (1 << 17, 1 << 20):
        gen = torch.Generator("cuda").manual_seed(n)
        scores = torch.exp(3 * torch.randn(n, device="cuda", generator=gen))  # spread over exponents, as votes are
        lives = (("all live", torch.tensor(n, device="cuda")), ("none live", torch.tensor(0, device="cuda")))
        for live_name, live in lives:
            assert torch.equal(this.topk(scores, K, live), other.topk(scores, K, live))
            for name, fn in (("this tree", this.topk), ("other", other.topk)):
                us = graph_us(lambda _, fn=fn: fn(scores, K, live), CALLS, REPLAYS)
                rows.append({"n": n, "live": live_name, "version": name, "graph_us": round(us, 2)})
                print(json.dumps(rows[-1]), flush=True)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "topk_passes.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "k": K,
                                                             "other": other_path, "rows": rows}, indent=1))
    print("| scores | live | this tree us | other us |\n|---|---|---|---|")
    for i in range(0, len(rows), 2):
        a, b = rows[i], rows[i + 1]
        print(f"| {a['n']} | {a['live']} | {a['graph_us']} | {b['graph_us']} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", metavar="OUTDIR", help="folder the results are written to (made if missing)")
    parser.add_argument("other_path", metavar="OTHER_TOPK_PY", help="the other version's kernels/topk.py")
    args = parser.parse_args()
    main(args.out, args.other_path)

"""Time the vote's top-k on a GPU: the Triton radix select (`tokenselect.kernels.topk.topk`) against the reference
(`torch.topk` + sort), eagerly and inside a CUDA graph (as decode steps run it), after checking they agree.

    python benchmarks/topk_gpu.py OUTDIR      # writes OUTDIR/topk_variants.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from tokenselect.bench.attention import graph_us, timer
from tokenselect.kernels.topk import topk, topk_ref

K, CALLS, REPLAYS = 2048, 20, 10


def timed(fn) -> tuple[float, float]:
    """(eager: the median of ``tokenselect bench attention``'s timer, in-graph) microseconds per call."""
    return timer(torch.device("cuda"))(fn) * 1e3, graph_us(lambda _: fn(), CALLS, REPLAYS)


def main(out: Path) -> None:
    rows = []
    for n in (1 << 15, 1 << 17, 1 << 19, 1 << 20):
        scores = torch.rand(n, device="cuda", generator=torch.Generator("cuda").manual_seed(n))  # a soft vote's range
        live, none = torch.tensor(n, device="cuda"), torch.tensor(0, device="cuda")
        assert torch.equal(topk(scores, K, live), topk_ref(scores, K))
        assert torch.equal(topk(scores, K, none), torch.arange(K, device="cuda"))
        for name, fn in {"torch.topk+sort (ref)": lambda: topk_ref(scores, K), "radix": lambda: topk(scores, K, live),
                         "radix, none live": lambda: topk(scores, K, none)}.items():
            eager, in_graph = timed(fn)
            rows.append({"n": n, "k": K, "variant": name, "eager_us": round(eager, 1), "graph_us": round(in_graph, 1)})
            print(rows[-1], flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "topk_variants.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "."))

"""Time the vote's top-k on a GPU: the Triton radix select (`tokenselect.kernels.topk.topk`) against the reference
(`torch.topk` + sort), eagerly and inside a CUDA graph (as decode steps run it), after checking they agree.

    python benchmarks/topk_gpu.py OUTDIR      # writes OUTDIR/topk_variants.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from tokenselect.bench.attention import timer
from tokenselect.kernels.topk import topk, topk_ref

K, CALLS, REPLAYS = 2048, 20, 10


def timed(fn) -> tuple[float, float]:
    """(eager: the median of ``tokenselect bench attention``'s timer, in-graph) microseconds per call."""
    eager = timer(torch.device("cuda"))(fn) * 1e3
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(REPLAYS):
        graph.replay()
    torch.cuda.synchronize()
    return eager, (time.perf_counter() - start) / (CALLS * REPLAYS) * 1e6


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

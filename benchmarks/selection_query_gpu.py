"""Ways to compute a prefill chunk's selection query (the fp32 mean of its queries, ``policies.base.selection_query``),
timed in CUDA graphs (``graph_us``, 32 calls a graph) on a GPU, each checked against the float64 mean first. The
profile of a 1M chunk (``attention_chunk_profile_gpu.py``) showed PyTorch's mean over the chunk's 512 rows taking
12 us, for 4 MB read.

    PYTHONPATH=$PWD python3 benchmarks/selection_query_gpu.py OUTDIR

Writes OUTDIR/selection_query.md.
"""
import sys
from pathlib import Path

import torch

from tokenselect.bench.attention import graph_us
from tokenselect.policies.base import selection_query


def variants(q: torch.Tensor) -> dict:
    c = q.shape[-3]
    return {
        "this tree's selection_query": lambda: selection_query(q),
        "mean(dtype=fp32), one pass": lambda: q.mean(dim=-3, dtype=torch.float32),
        "sum of 16 partial sums": lambda: q.unflatten(-3, (16, c // 16)).sum(dim=-3, dtype=torch.float32).sum(dim=-3)
        / c,
        "float() then mean": lambda: q.float().mean(dim=-3),
    }


def main(out: str) -> None:
    lines = ["| queries [.., c, heads, d] | way | us a call | max abs diff from the fp64 mean |", "|---|---|---|---|"]
    for shape in ((512, 32, 128), (4, 512, 32, 128), (2048, 32, 128), (512, 28, 128)):
        q = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        want = q.double().mean(dim=-3)
        for name, fn in variants(q).items():
            diff = (fn().double() - want).abs().max().item()
            us = graph_us(lambda _, fn=fn: fn(), 32, 20)
            lines.append(f"| {list(shape)} | {name} | {us:.2f} | {diff:.1e} |")
            print(lines[-1], flush=True)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "selection_query.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])

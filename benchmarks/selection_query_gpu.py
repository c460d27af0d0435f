"""Ways to compute a prefill chunk's selection query (the mean of its queries accumulated in fp32,
``kernels.query_mean``), timed in CUDA graphs (``graph_us``, 32 calls a graph) on a GPU, each checked against the
float64 mean first: this tree's kernel with its column block and others, and PyTorch's mean (the kernel's reference).
The profile of a 1M chunk (``attention_chunk_profile_gpu.py``) showed PyTorch's mean over the chunk's 512 rows taking
12 us for 4 MB read, and its cast to bf16 1 us more.

    PYTHONPATH=$PWD python3 benchmarks/selection_query_gpu.py OUTDIR

Writes OUTDIR/selection_query.md.
"""
import argparse
import importlib
from pathlib import Path
from unittest import mock

import torch

from tokenselect.bench.attention import graph_us
from tokenselect.kernels import get_kernels

query_mean = importlib.import_module("tokenselect.kernels.query_mean")  # the module (the package exports functions)


def variants(q: torch.Tensor) -> dict:
    """name -> (a call, the kernel's column block to run it with, or None)."""
    kernel = get_kernels("triton").query_mean
    ways = {"PyTorch's mean, then the cast (the reference)": (lambda: query_mean.query_mean_ref(q, q.dtype), None)}
    for cols in (query_mean.BLOCK_COLS, 32, 16):
        shipped = " (shipped)" if cols == query_mean.BLOCK_COLS else ""
        ways[f"the kernel, {cols} columns a program{shipped}"] = (lambda: kernel(q, q.dtype), cols)
    return ways


def main(out: str) -> None:
    lines = ["| queries [.., c, heads, d] | way | us a call | max abs diff from the fp64 mean |", "|---|---|---|---|"]
    for shape in ((512, 32, 128), (4, 512, 32, 128), (2048, 32, 128), (512, 28, 128)):
        q = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        want = q.double().mean(dim=-3)
        for name, (fn, cols) in variants(q).items():
            with mock.patch.object(query_mean, "BLOCK_COLS", cols or query_mean.BLOCK_COLS):
                diff = (fn().double() - want).abs().max().item()
                us = graph_us(lambda _, fn=fn: fn(), 32, 20)
            lines.append(f"| {list(shape)} | {name} | {us:.2f} | {diff:.1e} |")
            print(lines[-1], flush=True)
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "selection_query.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", metavar="OUTDIR", help="folder the results are written to (made if missing)")
    main(parser.parse_args().out)

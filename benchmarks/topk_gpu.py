"""Time the vote's top-k on a GPU: the Triton radix select (`tokenselect.kernels.topk.topk`) against the reference
(`torch.topk` + sort), eagerly and inside a CUDA graph (as decode steps run it), after checking they agree; the
radix select also with 1,024 and 4,096 scores a program (the shipped ``BLOCK`` is 2,048). Scores of two kinds:
uniform in [0, 1), and log-normal (exp of 3 x a normal: spread over many exponents, as a soft vote's are).

    python benchmarks/topk_gpu.py OUTDIR      # writes OUTDIR/topk_variants.json
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

import torch

from tokenselect.bench.attention import graph_us, timer
from tokenselect.kernels.topk import topk, topk_ref

topk_module = importlib.import_module("tokenselect.kernels.topk")  # the module (the package exports a function)

K, CALLS, REPLAYS = 2048, 20, 10


def timed(fn) -> tuple[float, float]:
    """(eager: the median of ``tokenselect bench attention``'s timer, in-graph) microseconds per call."""
    return timer(torch.device("cuda"))(fn) * 1e3, graph_us(lambda _: fn(), CALLS, REPLAYS)


def main(out: Path) -> None:
    rows = []
    shipped = topk_module.BLOCK
    for n in (1 << 15, 1 << 17, 1 << 19, 1 << 20):
        gen = torch.Generator("cuda").manual_seed(n)
        for dist, scores in (("uniform", torch.rand(n, device="cuda", generator=gen)),
                             ("log-normal", torch.exp(3 * torch.randn(n, device="cuda", generator=gen)))):
            live, none = torch.tensor(n, device="cuda"), torch.tensor(0, device="cuda")
            assert torch.equal(topk(scores, K, live), topk_ref(scores, K))
            assert torch.equal(topk(scores, K, none), torch.arange(K, device="cuda"))
            variants = {"torch.topk+sort (ref)": (shipped, lambda: topk_ref(scores, K)),
                        "radix, none live": (shipped, lambda: topk(scores, K, none))}
            for block in (1024, 2048, 4096):
                variants[f"radix, {block} a program"] = (block, lambda: topk(scores, K, live))
            for name, (block, fn) in variants.items():
                topk_module.BLOCK = block
                assert torch.equal(topk(scores, K, live), topk_ref(scores, K))
                eager, in_graph = timed(fn)
                rows.append({"n": n, "k": K, "scores": dist, "variant": name, "eager_us": round(eager, 1),
                             "graph_us": round(in_graph, 1)})
                print(rows[-1], flush=True)
            topk_module.BLOCK = shipped
    out.mkdir(parents=True, exist_ok=True)
    (out / "topk_variants.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, nargs="?", default=Path("."), metavar="OUTDIR",
                        help="folder the results are written to (made if missing; default the current one)")
    main(parser.parse_args().out)

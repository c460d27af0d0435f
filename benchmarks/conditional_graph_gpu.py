"""Issue #28's next step, probed: can a decode graph skip the Selection Cache's hit work with a CUDA-graph IF node,
and what does the node cost? A hit today still launches the scoring, vote and top-k kernels with no live
candidate (each reads nothing but is a node the graph runs); an IF node would leave them out on the device.

    python benchmarks/conditional_graph_gpu.py [--keys 131072] [--layers 32]

Prints whether this torch has ``CUDAGraph.begin_capture_to_if_node`` (torch's ``torch.cond`` capture uses it), then
for one graph of LAYERS layers of "score every key, then a top-k" gated by a device flag: the replay time with the
flag off and on, and the same graph without the gate, and checks that a gated-off replay leaves its output as it
was. Run on 2 H200s (2026-11-28, torch 2.11.0+cu130): that torch has no ``begin_capture_to_if_node``
(benchmarks/results/supporting/conditional_graph_h200.txt), so the probe stops there. PyTorch's source has the
binding from 2.13 (``torch/csrc/cuda/Graph.cpp``); the probe's timing part runs on such a CUDA build.
"""

from __future__ import annotations

import argparse

import torch

from tokenselect.bench.attention import replay_seconds


def replay_ms(graph: torch.cuda.CUDAGraph) -> float:
    return replay_seconds(graph, 50) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=131072, help="keys scored a layer")
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()
    has_if = hasattr(torch.cuda.CUDAGraph, "begin_capture_to_if_node")
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}: begin_capture_to_if_node {'yes' if has_if else 'no'}")
    if not has_if:
        return
    keys = torch.randn(args.layers, args.keys, 8, 128, device="cuda", dtype=torch.bfloat16)
    query = torch.randn(8, 128, device="cuda", dtype=torch.bfloat16)  # a query a kv head: reads every key once
    out = torch.zeros(args.layers, 2048, device="cuda", dtype=torch.int64)
    select = torch.ones((), device="cuda", dtype=torch.bool)  # the Selection Cache's miss, on the device

    def work(layer: int) -> None:
        scores = torch.einsum("gd,tgd->t", query, keys[layer])
        out[layer].copy_(torch.topk(scores.float(), out.shape[1]).indices)

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm up: the kernels' first launches happen outside any capture
        for layer in range(args.layers):
            work(layer)
    torch.cuda.synchronize()
    plain, gated = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(plain):
        for layer in range(args.layers):
            work(layer)
    with torch.cuda.graph(gated):
        capturing = torch.cuda.CUDAGraph.get_currently_capturing_graph()
        for layer in range(args.layers):
            capturing.begin_capture_to_if_node(select)
            work(layer)
            capturing.end_capture_to_conditional_node()
    print(f"ungated: {replay_ms(plain):.3f} ms")
    print(f"gated, flag on (a miss): {replay_ms(gated):.3f} ms")
    before = out.clone()
    out.fill_(-1)
    select.fill_(False)
    print(f"gated, flag off (a hit): {replay_ms(gated):.3f} ms")
    assert bool((out == -1).all()), "a gated-off replay wrote its output"
    select.fill_(True)
    gated.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, before), "a gated-on replay differs from the ungated one"
    print("checks: a gated-off replay leaves the output; a gated-on one gives the ungated output")


if __name__ == "__main__":
    main()

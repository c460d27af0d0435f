"""The sparse attention kernel's chunk tile (``sparse_attention.CHUNK_TILE``: rows, keys, warps, stages) timed as a
TokenSelect prefill runs it: a 2048-token chunk of the Llama-3-8B shape (32 query heads, 8 kv heads, d 128, bf16),
its four groups of 512 queries each over its own list of 3,200 entries (128 sinks, 2,048 chosen, the 512-token
window, the group's own 512), slots drawn from a 128K pool, new lists for each of 32 layers, in one CUDA graph
(``bench.attention.graph_us``). Each tile's output is first checked against the shipped tile's. Writes
OUT/chunk_attention_tiles.{json,md}.

    PYTHONPATH=$PWD python benchmarks/chunk_attention_tiles_gpu.py OUT [--tiles 64,64,4,3 128,64,8,3 ...]
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from unittest import mock

import torch

from tokenselect.bench.attention import graph_us

attention = importlib.import_module("tokenselect.kernels.sparse_attention")

GROUPS, QUERIES, HEADS, KV, D, POOL, LAYERS = 4, 512, 32, 8, 128, 131072, 32
LIST = 128 + 2048 + 512 + QUERIES
TILES = ["64,64,4,3", "128,64,8,3", "128,64,4,3", "128,128,8,2", "64,128,4,2", "128,32,4,4", "64,64,8,3",
         "128,64,8,2"]


def chunk_tile(tile: tuple[int, int, int, int]):
    """``sparse_attention`` launches chunks with ``tile`` inside the block (it reads CHUNK_TILE at each call)."""
    return mock.patch.object(attention, "CHUNK_TILE", tile)


def lists(gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """One layer's [GROUPS, LIST] slot lists: each group's chosen, sinks and window drawn from the pool, its own
    queries' slots last."""
    own = torch.arange(POOL - QUERIES * GROUPS, POOL).view(GROUPS, QUERIES)
    return torch.stack([torch.cat([torch.randperm(POOL - QUERIES * GROUPS, generator=gen)[:LIST - QUERIES], own[g]])
                        for g in range(GROUPS)]).to(device)


def operands(gen: torch.Generator, device: torch.device) -> dict:
    """The first layer's call: the queries, the pools, the groups' lists and positions (re-indexed: 0 .. LIST-1)."""
    positions = torch.arange(LIST, device=device)
    return dict(q=torch.randn(GROUPS, QUERIES, HEADS, D, generator=gen).to(device, torch.bfloat16),
                k_pool=torch.randn(POOL, KV, D, generator=gen).to(device, torch.bfloat16),
                v_pool=torch.randn(POOL, KV, D, generator=gen).to(device, torch.bfloat16), slots=lists(gen, device),
                key_pos=positions, q_pos=positions[-QUERIES:].expand(GROUPS, QUERIES),
                inv_freq=1.0 / (500000.0 ** (torch.arange(0, D, 2, device=device).float() / D)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--tiles", nargs="+", default=TILES, help="ROWS,KEYS,WARPS,STAGES (the first: the reference)")
    p.add_argument("--replays", type=int, default=10)
    args = p.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    pools = operands(gen, device)
    layers = [pools] + [{**pools, "slots": lists(gen, device)} for _ in range(LAYERS - 1)]
    flops = 4 * GROUPS * QUERIES * HEADS * D * (LIST - QUERIES + (QUERIES + 1) / 2)  # QK^T and PV, causal own part
    rows, want = [], None
    for text in args.tiles:
        tile = tuple(int(x) for x in text.split(","))
        with chunk_tile(tile):
            try:
                got = attention.sparse_attention(**layers[0])
                torch.cuda.synchronize()
            except Exception as err:  # a tile that does not fit (shared memory, registers)
                rows.append({"tile": tile, "error": f"{type(err).__name__}: {str(err)[:200]}"})
                print(rows[-1], flush=True)
                continue
            want = got if want is None else want
            diff = (got.float() - want.float()).abs().max().item()
            us = graph_us(lambda i: attention.sparse_attention(**layers[i]), LAYERS, args.replays)
        rows.append({"tile": tile, "us_per_layer": us, "tflops": flops / us / 1e6, "max_diff": diff})
        print(rows[-1], flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "chunk_attention_tiles.json").write_text(json.dumps(rows, indent=1))
    lines = [f"# Sparse attention's chunk tile: {GROUPS} groups x {QUERIES} queries, {HEADS}/{KV} heads, d {D}, bf16, "
             f"lists of {LIST}, {LAYERS} layers in one CUDA graph, on {torch.cuda.get_device_name()}", "",
             "| tile (rows, keys, warps, stages) | us a layer | TFLOP/s | max diff from the first |",
             "|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tile']} | {r['error']} | | |" if "error" in r else
                     f"| {r['tile']} | {r['us_per_layer']:.1f} | {r['tflops']:.0f} | {r['max_diff']:.1e} |")
    (out / "chunk_attention_tiles.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

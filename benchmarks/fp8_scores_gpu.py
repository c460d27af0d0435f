"""Why fp8 selection keys do not pay on an H200: the scores kernel (TokenSelect's key pass) over bf16 and fp8 keys,
its tiles, and the type the fp8 keys are multiplied in, on a GPU.

    python benchmarks/fp8_scores_gpu.py OUTDIR

The kernel runs as a decode step's soft vote runs it (``scores_with_stats``: 32 query heads, 8 kv heads, d 128, the
per-block softmax statistics, the live length read on the device) over N = 128K and 1M keys, at the slots a prefill
gives a sequence (consecutive, as in the engine) and at random ones. fp8 keys are multiplied in bf16 (shipped: the
query's own type) and in fp16 (every e4m3 value is an fp16 too; on sm_90 e4m3 converts to fp16 in one instruction a
pair, to bf16 through fp32). Each variant's scores are first checked against ``paged_dot_ref``; times are medians of
``triton.testing.do_bench`` (L2 flushed before each run), beside the floor of reading the keys once at the copy
bandwidth measured here. Writes OUTDIR/fp8_scores.{json,md}.
"""

from __future__ import annotations

import argparse
import importlib
import json

import torch
import triton.language as tl

# (benchmarks/: this script's folder)
from scores_tile_gpu import checked_and_timed, copy_bandwidth, lengths, pool_case, save

paged_dot = importlib.import_module("tokenselect.kernels.paged_dot")  # the module (the package exports a function)
SHIPPED_TILE, SHIPPED_DOT = paged_dot.SCORES_TILE, paged_dot.exact_dot_type
TILES = [SHIPPED_TILE, (128, 4, 8, 3), (128, 4, 4, 4), (256, 4, 4, 3), (256, 8, 4, 3), (128, 8, 8, 3), (64, 4, 8, 4)]


def fp16_products(q_dtype, k_dtype):
    """The dot type rule with fp8 keys multiplied in fp16."""
    if k_dtype == torch.float8_e4m3fn:
        return tl.float16, False
    return SHIPPED_DOT(q_dtype, k_dtype)


def main(out: str) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = copy_bandwidth(gen.device)
    rows = []
    for name, n, q, keys, live in lengths(gen):
        for order, slots in (("consecutive", torch.arange(512, 512 + n, device=gen.device)),
                             ("random", torch.randperm(n + 1024, device=gen.device, generator=gen)[:n])):
            for keys_name, dtype, rule in (("bf16", torch.bfloat16, SHIPPED_DOT),
                                           ("fp8, bf16 products", torch.float8_e4m3fn, SHIPPED_DOT),
                                           ("fp8, fp16 products", torch.float8_e4m3fn, fp16_products)):
                pool, want, floor_ms = pool_case(q, keys, dtype, slots, bandwidth)
                paged_dot.exact_dot_type = rule
                for tile in TILES if dtype != torch.bfloat16 else TILES[:1]:
                    paged_dot.SCORES_TILE = tile
                    row = {"length": name, "slots": order, "keys": keys_name, "tile": list(tile), "floor_ms": floor_ms}
                    rows.append(checked_and_timed(row, q, pool, slots, live, want))
                    print(json.dumps(row), flush=True)
                paged_dot.SCORES_TILE, paged_dot.exact_dot_type = SHIPPED_TILE, SHIPPED_DOT
    lines = [f"# Scores kernel, bf16 and fp8 keys, {torch.cuda.get_device_name()} (copy bandwidth "
             f"{bandwidth / 1e12:.2f} TB/s)", "",
             "Tile = (keys per block, warps, blocks per program, stages); the shipped one is "
             f"{tuple(SHIPPED_TILE)}.", "",
             "| length | slots | keys | tile | ms | of floor |", "|---|---|---|---|---|---|"]
    for r in rows:
        took = f"{r['error']} | " if "error" in r else f"{r['ms']:.4f} | {r['floor_ms'] / r['ms']:.0%}"
        lines.append(f"| {r['length']} | {r['slots']} | {r['keys']} | {tuple(r['tile'])} | {took} |")
    save(out, "fp8_scores", bandwidth, rows, lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", metavar="OUTDIR", help="folder the results are written to (made if missing)")
    main(parser.parse_args().out)

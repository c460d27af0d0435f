"""Sweep the decode tile of sparse attention on a GPU: one query of 32 q / 8 kv heads, d=128, bf16, over a
list of 2K (a TokenSelect selection), 32K and 128K keys (full attention), read as a whole-step graph reads it
(the live length on the device). Flash SDPA decoding over already-rotated contiguous keys is timed for scale;
the kernel is first checked against an fp32 reference at positions up to 1M.

    python benchmarks/decode_attention_gpu.py OUTDIR    # writes OUTDIR/decode_attention.{json,md}

Each timing is a CUDA graph of 32 calls, each over a different list (so that 2K lists do not sit in L2),
replayed 7 times: microseconds per call, the median replay.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# the module, not the function of that name that tokenselect.kernels exports
kernel = importlib.import_module("tokenselect.kernels.sparse_attention")

D, N_KV, N_HEADS, CALLS, REPLAYS = 128, 8, 32, 32, 7
LENGTHS = (2048, 32768, 131072)
TILES = [(16, keys, 4, stages) for keys in (16, 32, 64, 128) for stages in (2, 3)]
PROGRAMS = (264, 396, 792)


def per_call_us(call) -> float:
    """call(i) for i < CALLS captured in one graph; microseconds per call."""
    for i in range(2):  # compile, warm
        call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS):
            call(i)
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return statistics.median(times)


def main(out_dir: Path) -> None:
    torch.manual_seed(0)
    dev = torch.device("cuda")
    n_slots = LENGTHS[-1] + 8192
    k_pool, v_pool = (torch.randn(n_slots, N_KV, D, dtype=torch.bfloat16, device=dev) for _ in range(2))
    q = torch.randn(1, N_HEADS, D, dtype=torch.bfloat16, device=dev)
    inv_freq = 1.0 / 500_000.0 ** (torch.arange(0, D, 2, device=dev).float() / D)
    rows = [dict(kind="device", name=torch.cuda.get_device_name(), torch=torch.__version__)]

    n = LENGTHS[-1]
    slots = torch.arange(n, device=dev)
    for stride in (1, 8):  # positions up to 128K, up to 1M
        pos = slots * stride
        want = kernel.sparse_attention_ref(q.float(), k_pool.float(), v_pool.float(), slots, pos, pos[-1:], inv_freq)
        got = kernel.sparse_attention(q, k_pool, v_pool, slots, pos, pos[-1:], inv_freq,
                                      n_valid=torch.tensor(n, device=dev))
        rows.append(dict(kind="accuracy", max_position=int(pos[-1]), max_abs_diff=(got.float() - want).abs().max().item()))
        print(rows[-1], flush=True)

    default = (kernel.DECODE_TILE, kernel.TARGET_PROGRAMS)
    for n in LENGTHS:
        if n == LENGTHS[-1]:  # full attention: the whole cache, in order
            lists = [torch.arange(n, device=dev)] * CALLS
        else:
            lists = [torch.randperm(n_slots, device=dev)[:n].sort().values for _ in range(CALLS)]
        distinct = CALLS if n < LENGTHS[-1] else 4  # 4 copies of 128K keys and values already outgrow L2 (2.1 GB)
        keys = [k_pool[s].transpose(0, 1).unsqueeze(0).contiguous() for s in lists[:distinct]]
        values = [v_pool[s].transpose(0, 1).unsqueeze(0).contiguous() for s in lists[:distinct]]
        q_sdpa = q.transpose(0, 1).unsqueeze(0)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            us = per_call_us(lambda i: F.scaled_dot_product_attention(q_sdpa, keys[i % distinct], values[i % distinct],
                                                                      enable_gqa=True))
        rows.append(dict(kind="time", n=n, kernel="flash sdpa", us=us))
        print(rows[-1], flush=True)
        keys = values = None  # free the copies before the next length (the lambda above has run)
        live = torch.tensor(n, device=dev)
        for tile, programs in itertools.product(TILES, PROGRAMS):
            kernel.DECODE_TILE, kernel.TARGET_PROGRAMS = tile, programs
            us = per_call_us(lambda i: kernel.sparse_attention(q, k_pool, v_pool, lists[i], lists[i], lists[i][-1:],
                                                                inv_freq, n_valid=live))
            rows.append(dict(kind="time", n=n, kernel="sparse_attention", tile=list(tile), programs=programs, us=us))
            print(rows[-1], flush=True)
        kernel.DECODE_TILE, kernel.TARGET_PROGRAMS = default

    (out_dir / "decode_attention.json").write_text(json.dumps(rows, indent=1))
    (out_dir / "decode_attention.md").write_text(render(rows))


def render(rows: list[dict]) -> str:
    """The sweep as a table: one row per (tile, programs), one column per length; flash SDPA first."""
    times = [r for r in rows if r["kind"] == "time"]
    lengths = sorted({r["n"] for r in times})
    configs = list(dict.fromkeys((r["kernel"], tuple(r.get("tile", ())), r.get("programs")) for r in times))
    us = {(r["kernel"], tuple(r.get("tile", ())), r.get("programs"), r["n"]): r["us"] for r in times}
    device = next(r["name"] for r in rows if r["kind"] == "device")
    lines = [f"# Decode sparse attention, one query, 32 q / 8 kv heads, d=128, bf16, on {device}: us per call",
             "", "| kernel | tile (rows, keys, warps, stages) | programs | "
             + " | ".join(f"{n // 1024}K" for n in lengths) + " |", "|---|---|---|" + "---|" * len(lengths)]
    for name, tile, programs in configs:
        cells = " | ".join(f"{us[(name, tile, programs, n)]:.1f}" for n in lengths)
        lines.append(f"| {name} | {tile or '-'} | {programs or '-'} | {cells} |")
    lines.append("")
    for r in rows:
        if r["kind"] == "accuracy":
            lines.append(f"Positions up to {r['max_position']:,}: max abs difference from the fp32 reference "
                         f"{r['max_abs_diff']:.2e}.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, nargs="?", metavar="OUTDIR",
                        help="existing folder the results are written to")
    parser.add_argument("--render", type=Path, metavar="JSON", help="print the table of a JSON a run wrote, and stop")
    args = parser.parse_args()
    if args.render:
        print(render(json.loads(args.render.read_text())), end="")
    elif args.out is None:
        parser.error("give OUTDIR, or --render with a run's JSON")
    else:
        main(args.out)

"""Sweep sparse attention's decode tile and split-K target over a batch of sequences, each attending its own list of
TokenSelect's default length (128 sinks + 2,048 chosen + 512 window + its own token = 2,689 keys) at random slots of
one pool, as a batched selecting decode step's layer does (``SelectivePolicy.attend_batch``: one [B, n] list, no live
length). 32 q / 8 kv heads, d=128, bf16.

    PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/batched_decode_attention_gpu.py OUTDIR [--batches 1,2,4,8,16]

``batch_decode_profile_gpu.py`` found the kernel at 51% of its memory floor at 8 x 32K (38 us a layer against 21)
and 19% at one sequence. Each timing is ``decode_attention_gpu.per_call_us``: a CUDA graph of 32 calls, each over
different lists (none sits in L2), microseconds per call, the median of 7 replays; the merge of the splits included.
The floor is the K and V rows' bytes (B x n x 8 heads x 128 x 2 bytes, twice) at the measured copy bandwidth. Flash
SDPA over already-rotated, gathered, contiguous keys is timed for scale (what a dense decode over such lists costs).
Each tile is first checked against ``sparse_attention_ref``. Writes OUTDIR/batched_decode_attention.{json,md}.
"""
from __future__ import annotations

import argparse
import importlib
import itertools
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from decode_attention_gpu import CALLS, per_call_us  # benchmarks/, beside this script
from tokenselect.bench.floors import copy_bandwidth

kernel = importlib.import_module("tokenselect.kernels.sparse_attention")

D, N_KV, N_HEADS, N_LIST, POOL = 128, 8, 32, 2689, 300_000
TILES = [(16, keys, warps, stages) for keys in (32, 64, 128) for warps in (2, 4) for stages in (2, 3)]
PROGRAMS = (396, 792, 1584, 3168)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="folder for batched_decode_attention.{json,md}")
    p.add_argument("--batches", default="1,2,4,8,16", help="sequences a call")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    dev = torch.device("cuda")
    bandwidth = copy_bandwidth(dev)
    k_pool, v_pool = (torch.randn(POOL, N_KV, D, dtype=torch.bfloat16, device=dev) for _ in range(2))
    inv_freq = 1.0 / 500_000.0 ** (torch.arange(0, D, 2, device=dev).float() / D)
    key_pos = torch.arange(N_LIST, device=dev)
    rows = [dict(kind="device", name=torch.cuda.get_device_name(), sms=torch.cuda.get_device_properties(dev)
                 .multi_processor_count, bandwidth=bandwidth, shipped=[list(kernel.DECODE_TILE), kernel.TARGET_PROGRAMS])]
    default = (kernel.DECODE_TILE, kernel.TARGET_PROGRAMS)
    for batch in (int(b) for b in args.batches.split(",")):
        lists = [torch.stack([torch.randperm(POOL, device=dev)[:N_LIST] for _ in range(batch)]) for _ in range(CALLS)]
        q = torch.randn(batch, 1, N_HEADS, D, dtype=torch.bfloat16, device=dev)
        q_pos = torch.full((batch, 1), N_LIST - 1, device=dev)
        floor_us = batch * N_LIST * N_KV * D * 2 * 2 / bandwidth * 1e6
        keys = [kernel.rotate(k_pool[s], key_pos, inv_freq).transpose(1, 2).contiguous() for s in lists[:4]]
        values = [v_pool[s].transpose(1, 2).contiguous() for s in lists[:4]]
        q_sdpa = kernel.rotate(q[:, 0], q_pos[:, 0], inv_freq)[:, :, None]  # [B, H, 1, d]
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            us = per_call_us(lambda i: F.scaled_dot_product_attention(q_sdpa, keys[i % 4], values[i % 4],
                                                                      enable_gqa=True))
        rows.append(dict(kind="time", batch=batch, kernel="flash sdpa (4 lists, rotated, contiguous)", us=us,
                         floor_us=floor_us))
        print(rows[-1], flush=True)
        del keys, values
        want = kernel.sparse_attention_ref(q.float(), k_pool.float(), v_pool.float(), lists[0], key_pos, q_pos,
                                           inv_freq)
        for tile, programs in itertools.product(TILES, PROGRAMS):
            kernel.DECODE_TILE, kernel.TARGET_PROGRAMS = tile, programs
            got = kernel.sparse_attention(q, k_pool, v_pool, lists[0], key_pos, q_pos, inv_freq)
            error = (got.float() - want).abs().max().item()
            us = per_call_us(lambda i: kernel.sparse_attention(q, k_pool, v_pool, lists[i], key_pos, q_pos, inv_freq))
            rows.append(dict(kind="time", batch=batch, kernel="sparse_attention", tile=list(tile), programs=programs,
                             us=us, floor_us=floor_us, max_abs_diff=error))
            print(rows[-1], flush=True)
        kernel.DECODE_TILE, kernel.TARGET_PROGRAMS = default
        (args.out / "batched_decode_attention.json").write_text(json.dumps(rows, indent=1))
        (args.out / "batched_decode_attention.md").write_text(render(rows))
    print(render(rows))


def render(rows: list[dict]) -> str:
    """A row per (tile, programs), a column per batch (us, and the share of the floor); the shipped one marked."""
    device = rows[0]
    times = [r for r in rows if r["kind"] == "time"]
    batches = sorted({r["batch"] for r in times})
    configs = list(dict.fromkeys((r["kernel"], tuple(r.get("tile", ())), r.get("programs")) for r in times))
    cell = {(r["kernel"], tuple(r.get("tile", ())), r.get("programs"), r["batch"]): r for r in times}
    shipped = (tuple(device["shipped"][0]), device["shipped"][1])
    lines = [f"# Batched decode sparse attention over {N_LIST:,}-key lists, 32 q / 8 kv heads, d=128, bf16, on "
             f"{device['name']} ({device['sms']} SMs, {device['bandwidth'] / 1e9:,.0f} GB/s): us a call (of floor)", "",
             "| kernel | tile (rows, keys, warps, stages) | programs | " + " | ".join(f"B={b}" for b in batches) + " |",
             "|---|---|---|" + "---|" * len(batches)]
    for name, tile, programs in configs:
        cells = []
        for b in batches:
            r = cell.get((name, tile, programs, b))
            cells.append("-" if r is None else f"{r['us']:.1f} ({r['floor_us'] / r['us']:.0%})")
        mark = " (shipped)" if (tile, programs) == shipped else ""
        lines.append(f"| {name} | {tile or '-'}{mark} | {programs or '-'} | " + " | ".join(cells) + " |")
    errors = [r["max_abs_diff"] for r in times if "max_abs_diff" in r]
    if errors:
        lines += ["", f"Largest difference from the fp32 reference over every tile and batch: {max(errors):.2e}."]
    best = {b: min((r for r in times if r["batch"] == b and r["kernel"] == "sparse_attention"), key=lambda r: r["us"])
            for b in batches}
    lines += ["", "Fastest at each batch: " + "; ".join(
        f"B={b}: {tuple(r['tile'])}, {r['programs']} programs, {r['us']:.1f} us" for b, r in best.items()) + "."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

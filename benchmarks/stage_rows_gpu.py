"""Staging a decode step's attended value rows from host memory (value offload), timed on a GPU at the kernel's block
shapes: is the gather bound by PCIe's bandwidth, or by how few reads it keeps in flight?

    PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/stage_rows_gpu.py OUTDIR

A pinned, mapped V pool of 1M slots of 1 KiB (Llama-3-8B's fp8 values: 8 kv heads x 128), 2,689 rows a layer
(TokenSelect's 2,048 picks, 128 sinks, a 512-token window and the new token) at random slots, 32 layers in one CUDA
graph (each layer its own rows), with none of the rows kept on the device, 24% kept (the bench's random-weight model)
and 64% (SmolLM2's decode, ``supporting/decode_kept_values_smollm2_cpu.md``). ``stage_rows`` runs at each
(BLOCK_ROWS, BLOCK_WORDS) of SHAPES (module globals read at launch); ``gather_rows`` (what staged before the kept
rows) is the reference row. The floor is the fetched bytes at the bandwidth of one pinned host-to-device copy of them
all. Writes OUTDIR/stage_rows.{json,md}.
"""
from __future__ import annotations

import argparse
import json
from contextlib import nullcontext
from pathlib import Path
from unittest import mock

import torch

from scores_epilogue_gpu import graph_ms  # benchmarks/, beside this script
from tokenselect.kernels import row_copy
from tokenselect.kv_cache import pinned_empty

SLOTS, ROW_BYTES, ROWS, LAYERS = 1 << 20, 1024, 2689, 32
# (rows, 32-bit words) a program; the first is the shipped one
SHAPES = [(16, 256), (8, 256), (4, 256), (32, 256), (16, 128), (16, 64)]


def host_copy_gbps(nbytes: int) -> float:
    """GB/s of a pinned host-to-device copy of ``nbytes`` (median of 20)."""
    src = pinned_empty((nbytes,), torch.uint8)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return nbytes / (sorted(times)[10] * 1e-3) / 1e9


def layers_with_kept(pool: torch.Tensor, share: float, gen: torch.Generator) -> list[tuple]:
    """Each layer's (pool, slots, Kept) such that every staging finds the same ``share`` of its slots kept: the kept
    ones come first in the list and the device keeps as many rows, so a staging keeps just those again."""
    n_kept = int(share * ROWS)
    layers = []
    for _ in range(LAYERS):
        slots = torch.randperm(SLOTS, device="cuda", generator=gen)[:ROWS]
        kept = row_copy.Kept.empty(n_kept, pool, "cuda")
        row_copy.stage_rows(pool, slots, kept)
        layers.append((pool, slots, kept))
    return layers


def main(out: str) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool = pinned_empty((SLOTS, ROW_BYTES), torch.uint8)
    pool.copy_(torch.randint(0, 256, (SLOTS, ROW_BYTES), dtype=torch.uint8))
    copy_gbps = host_copy_gbps(ROWS * ROW_BYTES)
    rows = []
    for share in (0.0, 0.24, 0.64):
        layers = layers_with_kept(pool, share, gen)
        fetched = ROWS - int(share * ROWS)
        floor_us = fetched * ROW_BYTES / (copy_gbps * 1e9) * 1e6
        want = row_copy.gather_rows_ref(pool, layers[0][1].cpu())
        cases = [("gather_rows", None, lambda p, s, k: row_copy.gather_rows(p, s))]
        cases += [(f"stage_rows {shape}", shape, lambda p, s, k: row_copy.stage_rows(p, s, k)) for shape in SHAPES]
        for name, shape, fn in cases:
            with mock.patch.multiple(row_copy, BLOCK_ROWS=shape[0], BLOCK_WORDS=shape[1]) if shape else nullcontext():
                assert torch.equal(fn(*layers[0]).cpu(), want)
                counts = layers[0][2].counts.clone()
                fn(*layers[0])
                assert (layers[0][2].counts - counts).tolist() in ([ROWS, ROWS - fetched], [0, 0])  # (gather: none)
                us = graph_ms(fn, layers) * 1e3
            rows.append({"kept": share, "case": name, "us_a_layer": round(us, 2), "floor_us": round(floor_us, 2),
                         "gbps": round(fetched * ROW_BYTES / (us * 1e-6) / 1e9, 1), "copy_gbps": round(copy_gbps, 1)})
            print(json.dumps(rows[-1]), flush=True)
    lines = [f"# Staging value rows from host memory, {torch.cuda.get_device_name()}", "",
             f"{ROWS} rows of {ROW_BYTES} B a layer at random slots of a {SLOTS}-slot pinned pool, {LAYERS} layers in "
             f"a CUDA graph; a pinned host-to-device copy of them all runs at {copy_gbps:.1f} GB/s (the floor).", "",
             "| kept on the device | kernel (rows, words a program) | us a layer | floor us | GB/s fetched |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['kept']:.0%} | {r['case']} | {r['us_a_layer']} | {r['floor_us']} | {r['gbps']} |" for r in rows]
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "stage_rows.json").write_text(json.dumps(rows, indent=1))
    (Path(out) / "stage_rows.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", metavar="OUTDIR", help="folder the results are written to (made if missing)")
    main(parser.parse_args().out)

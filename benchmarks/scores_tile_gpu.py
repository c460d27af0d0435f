"""Sweep the scores kernel's tile (the key pass of TokenSelect's vote) over bf16 and fp8 keys on a GPU.

    python benchmarks/scores_tile_gpu.py OUTDIR

The kernel runs as the soft vote of a decode step runs it (``scores_with_stats``: 32 query heads, 8 kv heads,
d=128, per-block softmax statistics, the live length read on the device) over N random slots of a pool
holding N + 1024 keys, for N = 128K and 1M. Each tile's scores are first checked against ``paged_dot_ref``;
times are medians of ``triton.testing.do_bench`` (the L2 cache flushed before every run), next to the floor
of reading the keys once at the copy bandwidth measured here. Writes OUTDIR/scores_tile.{json,md}.
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path
from typing import Iterator

import torch
import triton.testing

paged_dot = importlib.import_module("tokenselect.kernels.paged_dot")  # the module (the package exports a function)

# (keys per block, warps, blocks per program, pipeline stages); the first is the shipped SCORES_TILE
TILES = [paged_dot.SCORES_TILE, (128, 4, 8, 3), (128, 8, 4, 3), (128, 4, 4, 4), (256, 4, 2, 3), (256, 8, 2, 3),
         (256, 8, 4, 3), (256, 4, 4, 3), (64, 4, 8, 3), (64, 4, 16, 3), (512, 8, 1, 3), (512, 8, 2, 3)]
LENGTHS = {"128K": 1 << 17, "1M": 1 << 20}
N_HEADS, N_KV, D = 32, 8, 128


def copy_bandwidth(dev: torch.device) -> float:
    """Bytes a second of a 1 GiB device-to-device copy (read + write counted)."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    ms = triton.testing.do_bench(lambda: b.copy_(a), return_mode="median")
    return 2 * a.numel() / (ms * 1e-3)


def operands(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A bf16 query [N_HEADS, D] and a pool of n + 1024 bf16 keys [n + 1024, N_KV, D], random, on gen's device."""
    q = torch.randn(N_HEADS, D, device=gen.device, generator=gen).to(torch.bfloat16)
    return q, torch.randn(n + 1024, N_KV, D, device=gen.device, generator=gen).to(torch.bfloat16)


def lengths(gen: torch.Generator) -> Iterator[tuple[str, int, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """For each of LENGTHS: its name, n, the query and pool of ``operands`` (drawn from gen in this order), and the
    live count n on gen's device (the kernel reads it there, as in a decode graph)."""
    for name, n in LENGTHS.items():
        q, keys = operands(n, gen)
        yield name, n, q, keys, torch.tensor(n, device=gen.device)


def pool_case(q: torch.Tensor, keys: torch.Tensor, dtype: torch.dtype, slots: torch.Tensor,
              bandwidth: float) -> tuple[torch.Tensor, torch.Tensor, float]:
    """The keys in ``dtype`` as the pool to score, ``paged_dot_ref``'s scores of its first 4096 slots (what
    ``checked_and_timed`` checks against), and the floor in ms of reading the slots' keys once at ``bandwidth``."""
    pool = keys.to(dtype)
    floor_ms = slots.numel() * N_KV * D * dtype.itemsize / bandwidth * 1e3
    return pool, paged_dot.paged_dot_ref(q, pool, slots[:4096]), floor_ms


def main(out: str) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = copy_bandwidth(gen.device)
    rows = []
    for name, n, q, keys, live in lengths(gen):
        slots = torch.randperm(n + 1024, device=gen.device, generator=gen)[:n]
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            pool, want, floor_ms = pool_case(q, keys, dtype, slots, bandwidth)
            for tile in TILES:
                paged_dot.SCORES_TILE = tile
                row = {"length": name, "keys": str(dtype).removeprefix("torch."), "tile": list(tile),
                       "floor_ms": floor_ms}
                rows.append(checked_and_timed(row, q, pool, slots, live, want))
                print(json.dumps(rows[-1]), flush=True)
    shipped = list(TILES[0])
    lines = [f"# Scores kernel tiles, {torch.cuda.get_device_name()} (copy bandwidth {bandwidth / 1e12:.2f} TB/s)",
             "", "Tile = (keys per block, warps, blocks per program, stages); the first is the shipped one.", "",
             "| length | keys | tile | ms | / floor | / shipped |", "|---|---|---|---|---|---|"]
    for r in rows:
        base = next(b for b in rows if (b["length"], b["keys"], b["tile"]) == (r["length"], r["keys"], shipped))
        if "error" in r:
            lines.append(f"| {r['length']} | {r['keys']} | {tuple(r['tile'])} | {r['error']} | | |")
            continue
        lines.append(f"| {r['length']} | {r['keys']} | {tuple(r['tile'])} | {r['ms']:.4f} | "
                     f"{r['ms'] / r['floor_ms']:.2f}x | {r['ms'] / base['ms']:.3f} |")
    save(out, "scores_tile", bandwidth, rows, lines)


def checked_and_timed(row: dict, q: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, live: torch.Tensor,
                      want: torch.Tensor) -> dict:
    """``row`` with the median ms of the scores kernel as it stands (its tile and dot type), once its scores of the
    first 4096 slots match ``want`` (``paged_dot_ref``); or with the error it raised."""
    call = lambda: paged_dot.scores_with_stats(q, pool, slots, 1.0, stats=True, n_valid=live)  # noqa: E731
    try:
        torch.testing.assert_close(call()[0][:, :4096], want, rtol=1e-3, atol=1e-3)
        row["ms"] = triton.testing.do_bench(call, return_mode="median")
    except Exception as err:  # e.g. a tile that needs more shared memory than the SM has
        row["error"] = f"{type(err).__name__}: {str(err)[:120]}"
    return row


def save(out: str, stem: str, bandwidth: float, rows: list[dict], lines: list[str]) -> None:
    """OUT/stem.json (the device, the copy bandwidth, the rows) and OUT/stem.md (the table's lines), printed too."""
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"{stem}.json").write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                                         "bandwidth": bandwidth, "rows": rows}, indent=1))
    (Path(out) / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", metavar="OUTDIR", help="folder the results are written to (made if missing)")
    main(parser.parse_args().out)

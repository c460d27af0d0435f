"""ReAttention's vote on the GPU: each (query, head) pair's best cached key, for one layer, two ways:

- scores: what ReAttention does for ``top`` > 1: ``paged_dot`` over blocks of queries (at most ``SCORE_ELEMENTS``
  floats of scores at a time), masked, ``torch.topk``, scattered into votes;
- one pass: ``paged_argmax`` (top 1, the default), which never writes the scores, then the same scatter; in each
  tile of ``--tiles`` (rows, keys a block, warps, stages) with the keys split as the kernel plans (``splits``), and
  the first tile once more in one split (the kernel before the splits: one program per row tile).

Both are timed with CUDA events (median of ``--repeats``) at each ``--lengths`` (the cached keys), for a 512-token
prefill chunk and for a decode step (one query), in the attention shapes of SmolLM2-135M (9 query heads, 3 kv heads,
head_dim 64), Qwen2.5-0.5B (14, 2, 64) and Llama-3-8B (32, 8, 128), with random bf16 keys at random slots; every
one-pass pick is compared with the scores path's (the share equal, and the largest score gap where they differ).
A 128K prompt's prefill runs the chunk's vote for every one of its 256 chunks in every layer.

    python benchmarks/reattention_vote_gpu.py --out OUT     # OUT/reattention_vote.{json,md}
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from tokenselect.kernels import get_kernels
from tokenselect.policies.reattention import SCORE_ELEMENTS

SHAPES = {"SmolLM2-135M": (9, 3, 64), "Qwen2.5-0.5B": (14, 2, 64), "Llama-3-8B": (32, 8, 128)}


def through_scores(kernels, rows: torch.Tensor, k_pool, middle, live, n_heads: int) -> torch.Tensor:
    """The scores path for top 1: blocks of queries, [rows, M] scores each, their top pick."""
    m = middle.numel()
    dead = torch.arange(m, device=middle.device) >= live
    chunk = rows.shape[0] // n_heads
    by_head = rows.view(n_heads, chunk, -1)
    block = max(1, SCORE_ELEMENTS // (n_heads * m))
    picks = []
    for start in range(0, chunk, block):
        part = by_head[:, start:start + block].reshape(-1, rows.shape[1])
        scores = kernels.paged_dot(part, k_pool, middle).masked_fill_(dead, float("-inf"))
        picks.append(torch.topk(scores, 1, dim=1).indices.view(n_heads, -1))
    return torch.cat(picks, dim=1).flatten()


def timed(fn, repeats: int) -> tuple[float, torch.Tensor]:
    """Median milliseconds of ``fn()`` over ``repeats`` runs after one warm-up (CUDA events; on a CPU, the
    clock: a trial of the script only), and its result."""
    out = fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            out = fn()
            times.append(1000 * (time.perf_counter() - begin))
    return statistics.median(times), out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--lengths", default="32768,131072,262144")
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--tiles", default="32,128,4,3;64,128,4,3;64,64,4,3;128,64,8,3;128,128,8,2",
                   help="paged_argmax tiles to time, ';'-separated rows,keys,warps,stages (the first also in one split)")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: TRITON_INTERPRET=1, small --lengths (a trial)
    kernels = get_kernels("triton")
    tiles = [tuple(map(int, t.split(","))) for t in args.tiles.split(";")]
    gen = torch.Generator(device=dev).manual_seed(0)
    rows_out = []
    for name in args.shapes.split(","):
        n_heads, n_kv, d = SHAPES[name]
        for m in map(int, args.lengths.split(",")):
            k_pool = torch.randn(m + 4096, n_kv, d, device=dev, generator=gen).to(torch.bfloat16)
            middle = torch.randperm(m + 4096, device=dev, generator=gen)[:m]
            live = torch.tensor(m - 7, device=dev)  # a ragged live end
            keys = k_pool[middle].float()
            votes = torch.zeros(m, dtype=torch.float64, device=dev)

            def voted(picks: torch.Tensor) -> torch.Tensor:
                votes.zero_().scatter_add_(0, picks, torch.ones(picks.numel(), dtype=votes.dtype, device=dev))
                return picks

            for step, queries in (("chunk", args.chunk), ("decode", 1)):
                rows = torch.randn(n_heads * queries, d, device=dev, generator=gen).to(torch.bfloat16)
                group_of_row = torch.arange(rows.shape[0], device=dev) // (rows.shape[0] // n_kv)
                score = lambda picks: (rows.float() * keys[picks, group_of_row]).sum(-1)  # noqa: E731
                old_ms, old = timed(lambda: voted(through_scores(kernels, rows, k_pool, middle, live, n_heads)),
                                    args.repeats)
                row = {"model": name, "cached_keys": m, "step": step, "queries": queries, "scores_ms": round(old_ms, 3),
                       "one_pass": []}
                for i, tile in enumerate(tiles):
                    for splits in ((None, 1) if i == 0 else (None,)):
                        ms, new = timed(lambda: voted(kernels.paged_argmax(rows, k_pool, middle, live, tile=tile,
                                                                           splits=splits)), args.repeats)
                        row["one_pass"].append({"tile": list(tile), "splits": splits or "planned", "ms": round(ms, 3),
                                                "same_picks": round((old == new).float().mean().item(), 5),
                                                "largest_score_gap": (score(old) - score(new)).abs().max().item()})
                best = min(row["one_pass"], key=lambda r: r["ms"])
                row["best"] = best
                rows_out.append(row)
                print({k: v for k, v in row.items() if k != "one_pass"}, flush=True)
    device = torch.cuda.get_device_name() if dev == "cuda" else "CPU (Triton's interpreter: a trial, not a timing)"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "reattention_vote.json").write_text(json.dumps({"device": device, "tiles": tiles, "rows": rows_out},
                                                               indent=1))
    name = lambda r: f"{'x'.join(map(str, r['tile']))}, {r['splits']} split{'s' if r['splits'] != 1 else ''}"  # noqa
    heads = [name(r) for r in rows_out[0]["one_pass"]]
    lines = [f"# ReAttention's vote, one layer, a {args.chunk}-token chunk and a decode step, on {device}", "",
             "Milliseconds (median of {}); one pass: tile rows x keys x warps x stages.".format(args.repeats), "",
             "| model shape | cached keys | step | scores + top-k | " + " | ".join(heads) + " | picks equal (worst) |",
             "|---|---|---|---|" + "---|" * len(heads) + "---|"]
    for r in rows_out:
        cells = [f"**{x['ms']}**" if x is r["best"] else str(x["ms"]) for x in r["one_pass"]]
        same = min(x["same_picks"] for x in r["one_pass"])
        lines.append(f"| {r['model']} | {r['cached_keys']} | {r['step']} | {r['scores_ms']} | " + " | ".join(cells)
                     + f" | {100 * same:.2f}% |")
    lines += ["", "Command: `python benchmarks/reattention_vote_gpu.py --out OUT`", ""]
    (args.out / "reattention_vote.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

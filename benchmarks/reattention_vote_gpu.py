"""ReAttention's prefill vote on the GPU: each (chunk query, head) pair's best cached key, for one layer and one
512-token chunk, two ways:

- scores: what ReAttention did for every ``top`` (and still does for top > 1): ``paged_dot`` over blocks of
  queries (at most ``SCORE_ELEMENTS`` floats of scores at a time), masked, ``torch.topk``, scattered into votes;
- one pass: ``paged_argmax`` (top 1, the default), which never writes the scores, then the same scatter.

Both are timed with CUDA events (median of ``--repeats``) at each ``--lengths`` (the cached keys the chunk scores),
for SmolLM2-135M's attention shape (9 query heads, 3 kv heads, head_dim 64) and Llama-3-8B's (32, 8, 128), with
random bf16 keys at random slots; the picks of the two are compared (the share equal, and the largest score gap
where they differ). A 128K prompt's prefill runs this for every one of its 256 chunks in every layer.

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

SHAPES = {"SmolLM2-135M": (9, 3, 64), "Llama-3-8B": (32, 8, 128)}


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
    p.add_argument("--lengths", default="32768,131072")
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: TRITON_INTERPRET=1, small --lengths (a trial)
    kernels = get_kernels("triton")
    gen = torch.Generator(device=dev).manual_seed(0)
    rows_out = []
    for name, (n_heads, n_kv, d) in SHAPES.items():
        for m in map(int, args.lengths.split(",")):
            k_pool = torch.randn(m + 4096, n_kv, d, device=dev, generator=gen).to(torch.bfloat16)
            middle = torch.randperm(m + 4096, device=dev, generator=gen)[:m]
            live = torch.tensor(m - 7, device=dev)  # a ragged live end
            rows = torch.randn(n_heads * args.chunk, d, device=dev, generator=gen).to(torch.bfloat16)
            votes = torch.zeros(m, dtype=torch.float64, device=dev)

            def voted(picks: torch.Tensor) -> torch.Tensor:
                votes.zero_().scatter_add_(0, picks, torch.ones(picks.numel(), dtype=votes.dtype, device=dev))
                return picks

            old_ms, old = timed(lambda: voted(through_scores(kernels, rows, k_pool, middle, live, n_heads)),
                                args.repeats)
            new_ms, new = timed(lambda: voted(kernels.paged_argmax(rows, k_pool, middle, live)), args.repeats)
            same = (old == new).float().mean().item()
            keys = k_pool[middle].float()
            group_of_row = torch.arange(rows.shape[0], device=dev) // (rows.shape[0] // n_kv)
            score = lambda picks: (rows.float() * keys[picks, group_of_row]).sum(-1)  # noqa: E731
            gap = (score(old) - score(new)).abs().max().item()
            rows_out.append({"model": name, "cached_keys": m, "chunk": args.chunk, "scores_ms": round(old_ms, 3),
                             "one_pass_ms": round(new_ms, 3), "speedup": round(old_ms / new_ms, 2),
                             "same_picks": round(same, 5), "largest_score_gap": gap})
            print(rows_out[-1], flush=True)
    device = torch.cuda.get_device_name() if dev == "cuda" else "CPU (Triton's interpreter: a trial, not a timing)"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "reattention_vote.json").write_text(json.dumps({"device": device, "rows": rows_out}, indent=1))
    lines = [f"# ReAttention's prefill vote, one layer and one {args.chunk}-token chunk, on {device}", "",
             "| model shape | cached keys | scores + top-k (ms) | one pass (ms) | speedup | picks equal | largest score gap |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['cached_keys']} | {r['scores_ms']} | {r['one_pass_ms']} | {r['speedup']}x | "
              f"{100 * r['same_picks']:.2f}% | {r['largest_score_gap']:.2e} |" for r in rows_out]
    lines += ["", "Command: `python benchmarks/reattention_vote_gpu.py --out OUT`", ""]
    (args.out / "reattention_vote.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

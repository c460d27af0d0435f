"""Where a TokenSelect prefill chunk's GPU time goes, kernel by kernel (issue #28: the fp8 chunk at 1M is 58x flash
SDPA where the goal is 60x): ``bench attention``'s one layer (Llama-3-8B's shape, a 512-query chunk, the policy
driven through its public API), its chunk step run CALLS times under torch.profiler, each kernel's device time a
call, summed by name.

    PYTHONPATH=$PWD python3 benchmarks/attention_chunk_profile_gpu.py OUTDIR [--length 1m] [--calls 20]
        [--chunk-tile ROWS,KEYS,WARPS,STAGES]   # sparse attention's chunk tile in place of the shipped one

Writes OUTDIR/attention_chunk_profile.md.
"""
import argparse
import importlib
from pathlib import Path
from unittest import mock

import torch
from torch.profiler import ProfilerActivity, profile

from tokenselect.bench.attention import Layer, add_parser
from tokenselect.eval.runner import parse_length
from tokenselect.kernels import get_kernels


def kernel_table(fn, calls: int) -> tuple[str, float]:
    """(markdown rows of each kernel's microseconds a call, the total a call) for ``calls`` calls of fn()."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            times[event.name] = times.get(event.name, 0.0) + event.device_time / calls
    total = sum(times.values())
    rows = [f"| {name[:90]} | {us:.1f} | {us / total:.0%} |" for name, us in sorted(times.items(), key=lambda x: -x[1])]
    return "\n".join(rows), total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("output", type=Path)
    ap.add_argument("--length", default="1m", type=parse_length)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--chunk-tile", type=lambda s: tuple(int(x) for x in s.split(",")),
                    help="sparse attention's chunk tile (rows,keys,warps,stages) instead of CHUNK_TILE")
    args = ap.parse_args()
    if args.chunk_tile:
        attention = importlib.import_module("tokenselect.kernels.sparse_attention")
        with mock.patch.object(attention, "CHUNK_TILE", args.chunk_tile):
            return run(args)
    return run(args)


def run(args) -> None:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    bench_args = parser.parse_args(["attention", "--fp8-select"])  # the bench's defaults: its shape and settings
    layer = Layer(args.length, bench_args, torch.device("cuda"))
    kern = get_kernels("triton")
    tile = f", sparse attention's chunk tile {args.chunk_tile}" if args.chunk_tile else ""
    lines = [f"# A TokenSelect chunk's kernels, {args.length} tokens, {torch.cuda.get_device_name()}{tile}", ""]
    for label, fp8 in (("bf16 selection keys", False), ("fp8 selection keys", True)):
        rows, total = kernel_table(layer.ours_chunk(kern, fp8=fp8), args.calls)
        lines += [f"## {label}: {total:.1f} us of kernels a call", "", "| kernel | us a call | share |",
                  "|---|---|---|", rows, ""]
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "attention_chunk_profile.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()

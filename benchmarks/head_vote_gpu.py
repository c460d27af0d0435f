"""The head soft vote as a decode step runs it (``head_soft_vote``: the scores kernel with its statistics, the heads'
totals, the vote), timed in a CUDA graph of one call a layer, on a GPU: this tree's kernels, or a packed tree's
(``PYTHONPATH=/tmp/before:$PWD/benchmarks``, after ``before_after_e2e.sh unpack``), each under its LABEL.

    PYTHONPATH=$PWD:$PWD/benchmarks python3 benchmarks/head_vote_gpu.py OUTDIR [LABEL]

32 query heads over 8 kv heads of d 128 (Llama-3-8B), fp8 keys at random slots, the live length read on the device;
32 layers at 128K tokens, 8 at 1M (no layer's keys in L2 for the next). Each call's vote is checked against the
first layer's reference vote (``head_soft_vote_ref``) before it is timed; the time is the median of 20 replays, per
layer, and the kernels' own device times come from one profiled run. Writes OUTDIR/head_vote_LABEL.json and prints
its rows.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from scores_epilogue_gpu import graph_ms  # benchmarks/, beside this script
from tokenselect.kernels.head_vote import head_soft_vote, head_soft_vote_ref

N_HEADS, N_KV, D = 32, 8, 128


def kernel_us(fn, layers) -> dict[str, float]:
    """Device microseconds a layer of each kernel ``fn`` launches, from one profiled run over the layers."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for args in layers:
            fn(*args)
        torch.cuda.synchronize()
    return {e.key: round(e.self_device_time_total / len(layers), 2) for e in prof.key_averages()
            if e.self_device_time_total > 0}


def main(out: str, label: str = "after") -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, n, n_layers in (("128K", 1 << 17, 32), ("1M", 1 << 20, 8)):
        layers = []
        for _ in range(n_layers):
            q = torch.randn(N_HEADS, D, device="cuda", generator=gen).to(torch.bfloat16)
            pool = torch.randn(n + 1024, N_KV, D, device="cuda", generator=gen).to(torch.float8_e4m3fn)
            slots = torch.randperm(n + 1024, device="cuda", generator=gen)[:n]
            layers.append((q, pool, slots, 1.0, torch.tensor(n, device="cuda")))
        want = head_soft_vote_ref(*layers[0][:3], 1.0)
        torch.testing.assert_close(head_soft_vote(*layers[0]), want, rtol=1e-3, atol=1e-6)
        ms = graph_ms(head_soft_vote, layers)
        rows.append({"tree": label, "length": name, "us_a_layer": round(ms * 1e3, 2),
                     "kernels_us": kernel_us(head_soft_vote, layers)})
        print(json.dumps(rows[-1]), flush=True)
        del layers
        torch.cuda.empty_cache()
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / f"head_vote_{label}.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", metavar="OUTDIR", help="folder the results are written to (made if missing)")
    parser.add_argument("label", nargs="?", default="after", metavar="LABEL",
                        help="the tree's name in the rows and the file's (default after)")
    args = parser.parse_args()
    main(args.out, args.label)

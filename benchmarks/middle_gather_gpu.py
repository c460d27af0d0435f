"""Time the one gather every selective layer runs: the chosen tokens' slots out of the middle of the table, written
into the attended list (``SelectivePolicy.assemble``), in the ways PyTorch offers and one small Triton kernel.

    python benchmarks/middle_gather_gpu.py OUTDIR      # writes OUTDIR/middle_gather.json

The profile of a 128K decode step showed ``torch.index_select(..., out=)`` as a ``gather`` kernel of 7.3 us a layer
(H100) for 2,048 int64 values. The Triton rows are ``kernels.gather_into`` with 1,024 and 256 (shipped) entries a
program. Each variant is checked against ``middle[chosen]``, then timed as a decode graph runs it: 32 calls (one a
layer) captured in one CUDA graph, replayed (``tokenselect.bench.attention.graph_us``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from tokenselect.bench.attention import graph_us
from tokenselect.kernels import row_copy

LAYERS, REPLAYS, K = 32, 20, 2048


def gather_into(src, index, out, block):
    """The shipped kernel with ``block`` entries a program."""
    shipped, row_copy.GATHER_BLOCK = row_copy.GATHER_BLOCK, block
    try:
        row_copy.gather_into(src, index, out)
    finally:
        row_copy.GATHER_BLOCK = shipped


def main(out_dir: Path) -> None:
    dev = torch.device("cuda")
    rows = []
    for n in (1 << 15, 1 << 17, 1 << 20):
        gen = torch.Generator(device=dev).manual_seed(n)
        table = torch.randperm(n + 640, device=dev, generator=gen)
        middle = table[128:n + 128]  # a slice of the table, as the policy's middle
        chosen = torch.randperm(n, device=dev, generator=gen)[:K].sort().values
        frame = torch.zeros(128 + K + 512 + 1, dtype=torch.int64, device=dev)
        dst = frame[128:128 + K]
        variants = {
            "index_select(out=)": lambda: torch.index_select(middle, 0, chosen, out=dst),
            "copy_(middle[chosen])": lambda: dst.copy_(middle[chosen]),
            "copy_(take)": lambda: dst.copy_(torch.take(middle, chosen)),
            "gather(out=)": lambda: torch.gather(middle, 0, chosen, out=dst),
            "triton gather_into (1024)": lambda: gather_into(middle, chosen, dst, 1024),
            "triton gather_into (256)": lambda: gather_into(middle, chosen, dst, 256),
        }
        want = middle[chosen]
        for name, fn in variants.items():
            dst.zero_()
            fn()
            torch.cuda.synchronize()
            assert torch.equal(dst, want), name
            us = graph_us(lambda _: fn(), LAYERS, REPLAYS)
            rows.append({"n": n, "k": K, "variant": name, "graph_us": round(us, 2)})
            print(rows[-1], flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "middle_gather.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                                           indent=1))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, nargs="?", default=Path("."), metavar="OUTDIR",
                        help="folder the results are written to (made if missing; default the current one)")
    main(parser.parse_args().out)

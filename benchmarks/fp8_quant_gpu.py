"""A prefill chunk's rows quantized to fp8 with a scale a row (``kernels/fp8_quant.py``), on a GPU: the Llama-3-8B
shape's projection inputs at 2048 rows (qkv's, o's and gate_up's 4096 wide; down's, the activation, 14336 wide),
each called 32 times in one CUDA graph over 32 inputs of
its own (a layer each, past L2). A time is the median of 20 replays over 32; the floor reads x and writes q and the
scales once at the copy bandwidth measured here.

With ``--other FILE`` (another version of ``fp8_quant.py``: ``git show REV:tokenselect/kernels/fp8_quant.py``, or
the file with a candidate applied, e.g. ``benchmarks/candidates/fp8_quant_hardware_cast.patch``) that module is
loaded beside the shipped one and timed alongside on the same machine; each is checked against the reference
(every byte and scale equal).

    python benchmarks/fp8_quant_gpu.py OUTDIR [--other FILE]

Writes OUTDIR/fp8_quant.{json,md}.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch

# (benchmarks/: this script's folder)
from fp8_weights_gpu import cell, write_report
from scores_epilogue_gpu import graph_ms
from tokenselect.bench.floors import copy_bandwidth
from tokenselect.kernels import fp8_quant

INPUTS = {"qkv, o, gate_up": 4096, "down": 14336}
ROWS, LAYERS = 2048, 32


def load_other(path: str):
    """The module at ``path`` as ``tokenselect.kernels.fp8_quant_other`` (its relative imports resolve)."""
    spec = importlib.util.spec_from_file_location("tokenselect.kernels.fp8_quant_other", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(out: str, other: str | None) -> None:
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(torch.device("cuda"))
    versions = {"shipped": fp8_quant.quantize_fp8_rows}
    if other:
        versions[Path(other).name] = load_other(other).quantize_fp8_rows
    rows = []
    for name, width in INPUTS.items():
        xs = [torch.randn(ROWS, width, device="cuda", dtype=torch.bfloat16) for _ in range(LAYERS)]
        want_q, want_scale = fp8_quant.quantize_fp8_ref(xs[0], per_row=True)
        floor_us = ROWS * width * 3 / bandwidth * 1e6  # bf16 read, e4m3 written (the scales are 8 KB)
        for version, fn in versions.items():
            q, scale = fn(xs[0])
            same = torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(scale, want_scale)
            us = graph_ms(fn, [(x,) for x in xs]) * 1e3
            rows.append({"input": name, "rows": ROWS, "width": width, "version": version, "us": round(us, 2),
                         "floor_us": round(floor_us, 2), "floor_fraction": round(floor_us / us, 3),
                         "equals_reference": same})
            print(json.dumps(rows[-1]), flush=True)
        del xs
    heading = [f"# A prefill chunk's rows quantized to fp8, {torch.cuda.get_device_name()} (copy bandwidth "
               f"{bandwidth / 1e12:.2f} TB/s, torch {torch.__version__})", "",
               f"`python benchmarks/fp8_quant_gpu.py OUTDIR{' --other ' + other if other else ''}`. us a call "
               f"({ROWS} rows, a CUDA graph of {LAYERS} inputs past L2); the floor reads x and writes q once.", ""]
    columns = {"input": cell("input"), "width": cell("width"), "version": cell("version"), "us": cell("us"),
               "floor us": cell("floor_us"), "floor fraction": cell("floor_fraction"),
               "equals the reference": lambda r: "yes" if r["equals_reference"] else "NO"}
    write_report(out, "fp8_quant", {"device": torch.cuda.get_device_name(), "copy_bandwidth": bandwidth, "rows": rows},
                 heading, columns)

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("outdir", help="where fp8_quant.{json,md} are written")
    parser.add_argument("--other", help="another version of tokenselect/kernels/fp8_quant.py, timed alongside")
    args = parser.parse_args()
    main(args.outdir, args.other)

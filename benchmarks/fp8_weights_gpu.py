"""fp8 weights against bf16: the Llama-3-8B shape's matrix products, on a GPU.

    python benchmarks/fp8_weights_gpu.py OUTDIR

For each projection (qkv, o, gate_up, down, the LM head) and each token count M (1-16: decode steps; 32-64: large
batches; 128-256: short prefill chunks; 2048: a prefill chunk) it times ``F.linear`` in bf16; ``torch._scaled_mm``
on fp8 operands with a scale a row of each ("rowwise", the product alone); and the shipped path,
``models.fp8.Fp8Linear``: up to 32 rows the Triton kernel ``kernels.fp8_product`` (the weight widened in registers,
the rows as they are, K split into ``parts_for`` parts), beyond it the rows' quantization (``kernels.fp8_quant``) and
the row-wise product. Up to 32 rows it also sweeps the kernel's tiles and splits of K (``CANDIDATES`` x ``PARTS``,
beside the shipped ``TILES`` and ``parts_for``). Each runs 40 times in one CUDA
graph over enough copies of the weight that none is read from L2; a time is the median over 20 replays, divided by
40. Beside each: the floor of reading the weight once at the copy bandwidth measured here (bytes read and written
over the time), and the TFLOP/s. The shipped path's output is checked against its reference first, and its error
is against the bf16 product. Writes OUTDIR/fp8_weights.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

# (benchmarks/: this script's folder)
from scores_epilogue_gpu import graph_ms
from tokenselect.bench.floors import copy_bandwidth
from tokenselect.kernels import fp8_product
from tokenselect.kernels.fp8_quant import quantize_fp8_rows
from tokenselect.models.fp8 import Fp8Linear, fp8_product_ref, quantizes

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
TOKENS = (1, 8, 16, 32, 64, 128, 256, 2048)
CANDIDATES = {16: [(32, 256, 4, 4), (16, 256, 4, 4), (32, 128, 4, 6), (64, 256, 4, 4)],
              32: [(32, 256, 4, 4), (16, 256, 4, 4), (32, 128, 4, 4)]}
PARTS = (1, 2, 3, 4, 6, 8)


def variants(x: torch.Tensor, linears: list, fp8: list, head: bool) -> dict:
    """name -> (fn(i) over the i-th weight copy, bytes of a weight element)."""
    rows = x.shape[0]
    q, scale = quantize_fp8_rows(x)
    out = {"bf16": (lambda i: F.linear(x, linears[i].weight), 2),
           "fp8 rowwise, product": (lambda i: torch._scaled_mm(q, fp8[i].weight.t(), scale_a=scale,
                                                               scale_b=fp8[i].weight_scale_row,
                                                               out_dtype=torch.bfloat16), 1)}
    if head:  # the head keeps the model's dtype
        return out
    out[f"Fp8Linear ({'rowwise' if quantizes(x) else 'fp8_weight_product'})"] = (lambda i: fp8[i](x), 1)
    if rows <= fp8_product.MAX_ROWS:
        block_m = min(m for m in fp8_product.TILES if m >= rows)
        for tile in CANDIDATES[block_m]:
            for parts in PARTS:
                out[f"fp8_weight_product {tile} parts {parts}"] = (partial(tiled, tile, parts, x, fp8), 1)
    return out


def tiled(tile: tuple, parts: int, x: torch.Tensor, fp8: list, i: int) -> torch.Tensor:
    """fp8_weight_product with ``tile`` and K in ``parts`` parts over the i-th weight copy."""
    return fp8_product.fp8_weight_product(x, fp8[i].weight, fp8[i].weight_scale, tile=tile, parts=parts)


def main(out: str, tokens: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    bandwidth = copy_bandwidth(torch.device("cuda"))
    rows = []
    for name, (n, k) in SHAPES.items():
        copies = max(1, math.ceil(400e6 / (n * k)))  # fp8 copies past L2 (400 MB); bf16 likewise
        linears = []
        for _ in range(copies):
            linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
            torch.nn.init.normal_(linear.weight, std=0.02)
            linears.append(linear)
        fp8 = [Fp8Linear(linear) for linear in linears]
        for m in tokens:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x, linears[0].weight).float()
            got = fp8[0](x)
            ref = (fp8_product_ref(x, fp8[0]) if quantizes(x) else
                   fp8_product.fp8_weight_product_ref(x, fp8[0].weight, fp8[0].weight_scale))
            torch.testing.assert_close(got, ref, atol=2e-2, rtol=2e-2)
            err = ((got.float() - want).norm() / want.norm()).item()
            for variant, (fn, bytes_per) in variants(x, linears, fp8, name == "lm_head").items():
                try:
                    us = graph_ms(fn, [(i % copies,) for i in range(40)]) * 1e3
                except RuntimeError as e:
                    rows.append({"proj": name, "m": m, "variant": variant, "error": str(e).splitlines()[0]})
                    print(json.dumps(rows[-1]), flush=True)
                    continue
                floor_us = n * k * bytes_per / bandwidth * 1e6  # the weight read once
                rows.append({"proj": name, "n": n, "k": k, "m": m, "variant": variant, "us": round(us, 2),
                             "weight_floor_us": round(floor_us, 2), "floor_fraction": round(floor_us / us, 3),
                             "tflops": round(2 * m * n * k / us / 1e6, 1),
                             "rel_error_vs_bf16": round(err, 5) if variant.startswith("Fp8Linear") else None})
                print(json.dumps(rows[-1]), flush=True)
        del linears, fp8
        torch.cuda.empty_cache()
    heading = [f"# Matrix products in bf16 and fp8, {torch.cuda.get_device_name()} (copy bandwidth "
               f"{bandwidth / 1e12:.2f} TB/s, torch {torch.__version__})", "",
               "`python benchmarks/fp8_weights_gpu.py OUTDIR`. us a product (a CUDA graph of 40, weights past L2); "
               "the floor reads the weight once.", ""]
    columns = {"proj": cell("proj"), "M": cell("m"), "variant": cell("variant"),
               "us": lambda r: f"error: {r['error']}" if "error" in r else r["us"],
               "weight floor us": cell("weight_floor_us"), "floor fraction": cell("floor_fraction"),
               "TFLOP/s": cell("tflops"), "rel. error vs bf16": cell("rel_error_vs_bf16")}
    write_report(out, "fp8_weights", {"device": torch.cuda.get_device_name(), "copy_bandwidth": bandwidth, "rows": rows},
                 heading, columns)


def write_report(outdir: str | Path, stem: str, payload: dict, heading: list[str], columns: dict) -> None:
    """OUTDIR/STEM.json (``payload``, whose "rows" the table shows) and OUTDIR/STEM.md: ``heading``'s lines, then a
    table of a column for each entry of ``columns`` (its header -> a function of a row giving the cell); printed
    too. (Also the other fp8 scripts' report.)"""
    outdir = Path(outdir)
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / f"{stem}.json").write_text(json.dumps(payload, indent=1))
    lines = [*heading, "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(fn(r)) for fn in columns.values()) + " |" for r in payload["rows"]]
    (outdir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def cell(key: str):
    """A column of ``write_report``: the row's ``key``, blank where the row has none."""
    return lambda r: "" if r.get(key) is None else r[key]

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("outdir", help="where fp8_weights.{json,md} are written")
    parser.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="token counts M, comma separated")
    args = parser.parse_args()
    main(args.outdir, tuple(int(m) for m in args.tokens.split(",")))

"""What the hardware allows for two of issue #28's targets, from the benches' own floor model (``bench.floors``) and
Llama-3-8B's shape (``bench e2e``'s ``llama3-8b``), at a measured copy bandwidth and GEMM throughput:

- 8 concurrent 32K-token requests, decode tokens/s >= 3x dense: a step's floor is its bytes over the bandwidth. The
  weights are read once a step for the batch, each request's attention (and, when it selects, its scoring) once a
  request. TokenSelect's defaults with fp8 selection keys, at a Selection Cache hit rate of 0, a real model's and 1.
- a 128K prefill in <= 3.0 s: the GEMMs' FLOPs (every matrix of every layer, each prompt token; the output head for
  the last token only) over the GEMM throughput, and what that leaves for everything else.

    python3 benchmarks/target_floors.py [--bandwidth 4.25e12] [--gemm-tflops 766] [--hit-rate 0.21]

Prints a markdown table. No device is used: the figures are arithmetic on the given rates.
"""
import argparse

from tokenselect.bench.e2e import CONFIGS
from tokenselect.bench.floors import decode_floor, weight_bytes

TOKENSELECT = {"attention": "tokenselect", "k": 2048, "n_init": 128, "n_local": 512, "dense_until": 0}


def batch_floor_ms(config: dict, settings: dict | None, length: int, batch: int, bandwidth: float,
                   select_bytes: int | None, hit_rate: float) -> float:
    """Milliseconds a decode step of ``batch`` requests of ``length`` tokens must take: the weights once, each
    request's attention and scoring (``decode_floor``'s parts) once a request."""
    one = decode_floor(config, settings, length, bandwidth, select_bytes=select_bytes, hit_rate=hit_rate)
    return (one["weights"] + batch * (one["scoring"] + one["attention"])) / bandwidth * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bandwidth", type=float, default=4.25e12, help="copy bandwidth, bytes/s (an H200's, measured)")
    ap.add_argument("--gemm-tflops", type=float, default=766.0, help="the GEMMs' measured bf16 throughput")
    ap.add_argument("--hit-rate", type=float, default=0.21, help="a real model's Selection Cache hit rate")
    args = ap.parse_args()
    config = CONFIGS["llama3-8b"]
    length, batch = 32768, 8
    dense = batch_floor_ms(config, None, length, batch, args.bandwidth, None, 0.0)
    print(f"| {batch} x {length // 1024}K decode step | floor ms | at most x dense |\n|---|---|---|")
    print(f"| dense (every token's K and V) | {dense:.2f} | 1.00x |")
    for label, hits in (("TokenSelect, every layer selecting", 0.0),
                        (f"TokenSelect at a {args.hit_rate:.0%} hit rate", args.hit_rate),
                        ("TokenSelect, every layer a hit", 1.0)):
        ms = batch_floor_ms(config, TOKENSELECT, length, batch, args.bandwidth, 1, hits)
        print(f"| {label} (fp8 selection keys) | {ms:.2f} | {dense / ms:.2f}x |")
    matrices = weight_bytes(config, 1) - config["vocab_size"] * config["hidden_size"]  # elements (norms too), no head
    prompt = 131072
    flops = 2 * matrices * prompt + 2 * config["vocab_size"] * config["hidden_size"]
    gemm_s = flops / (args.gemm_tflops * 1e12)
    print(f"\n| {prompt // 1024}K prefill | seconds |\n|---|---|")
    print(f"| the GEMMs: {flops:.3e} FLOP at {args.gemm_tflops:.0f} TFLOP/s | {gemm_s:.2f} |")
    print(f"| left for attention, selection, norms and RoPE under 3.0 s | {3.0 - gemm_s:.2f} |")


if __name__ == "__main__":
    main()

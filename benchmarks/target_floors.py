"""What the hardware allows for two of issue #28's targets, from the benches' own floor model (``bench.floors``) and
Llama-3-8B's shape (``bench e2e``'s ``llama3-8b``), at a measured copy bandwidth and GEMM throughput:

- 8 concurrent 32K-token requests, decode tokens/s >= 3x dense: a step's floor is its bytes over the bandwidth. The
  weights are read once a step for the batch, each request's attention (and, when it selects, its scoring) once a
  request. TokenSelect's defaults with fp8 selection keys, at a Selection Cache hit rate of 0, real models' and 1;
  each floor against dense's floor and against the dense step as measured (the target's baseline).
- a 128K prefill in <= 3.0 s: the GEMMs' FLOPs (every matrix of every layer, each prompt token; the output head for
  the last token only) over the GEMM throughput, and what that leaves for everything else.

    python3 benchmarks/target_floors.py [--bandwidth 4.25e12] [--gemm-tflops 766] [--hit-rates 0.21,0.66,0.81]
                                        [--dense-ms 14.86]

Prints a markdown table. No device is used: the figures are arithmetic on the given rates.
"""
import argparse

from tokenselect.bench.e2e import CONFIGS
from tokenselect.bench.floors import decode_floor, prefill_flops
from tokenselect.policies.tokenselect import TokenSelectSettings

DEFAULTS = TokenSelectSettings()  # the policy's own defaults, selecting from the first token past its fixed ones
TOKENSELECT = {"attention": "tokenselect", "k": DEFAULTS.k, "n_init": DEFAULTS.n_init, "n_local": DEFAULTS.n_local,
               "dense_until": 0}


def batch_floor_ms(config: dict, settings: dict | None, length: int, batch: int, bandwidth: float,
                   select_bytes: int | None, hit_rate: float) -> float:
    """Milliseconds a decode step of ``batch`` requests of ``length`` tokens must take (``decode_floor``: the weights
    once, each request's attention and scoring once a request)."""
    return decode_floor(config, settings, length, bandwidth, select_bytes=select_bytes, hit_rate=hit_rate,
                        batch=batch)["floor_ms"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bandwidth", type=float, default=4.25e12, help="copy bandwidth, bytes/s (an H200's, measured)")
    ap.add_argument("--gemm-tflops", type=float, default=766.0, help="the GEMMs' measured bf16 throughput")
    ap.add_argument("--hit-rates", default="0.21,0.66,0.81",
                    help="real models' Selection Cache hit rates (SmolLM2's on prose; Qwen2.5's on tasks, on prose)")
    ap.add_argument("--dense-ms", type=float, default=14.86,
                    help="the best dense step at 8 x 32K as measured (throughput_32k_h200: full attention's)")
    args = ap.parse_args()
    config = CONFIGS["llama3-8b"]
    length, batch = 32768, 8
    dense = batch_floor_ms(config, None, length, batch, args.bandwidth, None, 0.0)
    print(f"| {batch} x {length // 1024}K decode step | floor ms | at most x dense's floor | at most x dense as "
          f"measured ({args.dense_ms} ms) |\n|---|---|---|---|")
    print(f"| dense (every token's K and V) | {dense:.2f} | 1.00x | {args.dense_ms / dense:.2f}x |")
    rates = [float(r) for r in args.hit_rates.split(",")]
    for label, hits in [("every layer selecting", 0.0), *((f"at a {r:.0%} hit rate", r) for r in rates),
                        ("every layer a hit", 1.0)]:
        ms = batch_floor_ms(config, TOKENSELECT, length, batch, args.bandwidth, 1, hits)
        print(f"| TokenSelect, {label} (fp8 selection keys) | {ms:.2f} | {dense / ms:.2f}x | "
              f"{args.dense_ms / ms:.2f}x |")
    selecting, all_hits = (batch_floor_ms(config, TOKENSELECT, length, batch, args.bandwidth, 1, h) for h in (0.0, 1.0))
    need = (selecting - args.dense_ms / 3) / (selecting - all_hits)  # the floor falls linearly with the hit rate
    print(f"\n3x dense as measured needs a step of {args.dense_ms / 3:.2f} ms: at the floor, a hit rate of {need:.1%}.")
    prompt = 131072
    flops = prefill_flops(config, None, prompt, prompt)["matmuls"]
    gemm_s = flops / (args.gemm_tflops * 1e12)
    print(f"\n| {prompt // 1024}K prefill | seconds |\n|---|---|")
    print(f"| the GEMMs: {flops:.3e} FLOP at {args.gemm_tflops:.0f} TFLOP/s | {gemm_s:.2f} |")
    print(f"| left for attention, selection, norms and RoPE under 3.0 s | {3.0 - gemm_s:.2f} |")


if __name__ == "__main__":
    main()

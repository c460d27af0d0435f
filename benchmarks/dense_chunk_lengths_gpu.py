"""Why the dense runner's 512-token chunks gain nothing by cuDNN (128K: 19.44 s against flash's 19.32,
``results/e2e_sdpa_h200.md``) when one such chunk's attention, timed again and again at one shape, is 2x faster by
it (``supporting/dense_backends_h200.md``). The suspicion: cuDNN builds an execution plan on the host for every new
shape, and every chunk of a growing prompt brings a new key length.

One Llama-3-8B attention layer (32 query heads, 8 kv heads, d 128, bf16), a 512-query chunk at the end of L keys
(``bench.dense.causal_attention``, flash or cuDNN), timed per call with the host waiting for the device (what a
layer of a chunked prefill costs): ``same length``, 20 calls at L = 64K; ``new lengths``, 20 calls at 64K + 512 i,
as a chunked prefill meets them, each length seen once. ``host ms`` is the call's own time on the host (its launch,
before the wait), ``wall ms`` the call with the wait; medians, after one untimed call at 32K.

    PYTHONPATH=$PWD python3 benchmarks/dense_chunk_lengths_gpu.py OUTDIR

Writes OUTDIR/dense_chunk_lengths.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tokenselect.bench.dense import causal_attention

H, KV, D, C = 32, 8, 128, 512


def timed(sdpa: str, lengths: list[int], gen: torch.Generator) -> dict:
    keys = torch.randn(1, KV, max(lengths), D, device="cuda", dtype=torch.bfloat16, generator=gen)
    values = torch.randn_like(keys)
    q = torch.randn(1, H, C, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    causal_attention(q, keys[:, :, :32768], values[:, :, :32768], sdpa)  # the backend's first call, untimed
    host, wall = [], []
    for L in lengths:
        torch.cuda.synchronize()
        start = time.perf_counter()
        causal_attention(q, keys[:, :, :L], values[:, :, :L], sdpa)
        launched = time.perf_counter()
        torch.cuda.synchronize()
        host.append((launched - start) * 1e3)
        wall.append((time.perf_counter() - start) * 1e3)
    median = lambda xs: round(sorted(xs)[len(xs) // 2], 3)
    return {"host_ms": median(host), "wall_ms": median(wall), "max_wall_ms": round(max(wall), 3)}


def main(out: Path) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    cases = {"same length": [65536] * 20, "new lengths": [65536 + C * i for i in range(20)]}
    rows = [{"sdpa": sdpa, "lengths": name, **timed(sdpa, lengths, gen)}
            for sdpa in ("flash", "cudnn") for name, lengths in cases.items()]
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    (out / "dense_chunk_lengths.json").write_text(json.dumps({"device": device, "torch": torch.__version__,
                                                              "cudnn": torch.backends.cudnn.version(),
                                                              "rows": rows}, indent=1))
    lines = [f"# A 512-query chunk over 64K keys, one layer, at one length and at new lengths, on {device}", "",
             f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}; medians of 20 calls, each waited for.",
             "", "| sdpa | key lengths | host ms | wall ms | slowest wall ms |", "|---|---|---|---|---|"]
    lines += [f"| {r['sdpa']} | {r['lengths']} | {r['host_ms']} | {r['wall_ms']} | {r['max_wall_ms']} |" for r in rows]
    (out / "dense_chunk_lengths.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, metavar="OUTDIR", help="folder the results are written to (made if missing)")
    main(parser.parse_args().out)

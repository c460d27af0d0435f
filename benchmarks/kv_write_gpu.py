"""Time a step's KV write on a GPU, the way the engine now runs it against the way it ran it before, at the
Llama-3-8B shape (8 kv heads x 128, keys and values sliced from the q/k/v product's rows), inside a CUDA graph
of 32 calls (one per layer, as a decode step captured as one graph runs them: the gaps between nodes count), after
checking that both write the same bytes: K, V (and with fp8 selection keys the keys' fp8 copy) as one
``index_put`` each, against one ``scatter_rows`` launch (``kernels/row_copy.py``, what ``KVCache.write`` runs).

    python benchmarks/kv_write_gpu.py OUTDIR      # writes OUTDIR/kv_write.{json,md}
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from tokenselect.bench.attention import graph_us
from tokenselect.kernels.row_copy import scatter_rows

LAYERS, REPLAYS = 32, 20
N_KV, D, N_HEADS, SLOTS = 8, 128, 32, 1 << 15


def kv_write_rows(rows: int) -> list[dict]:
    dev, bf16, fp8 = "cuda", torch.bfloat16, torch.float8_e4m3fn
    qkv = torch.randn(rows, (N_HEADS + 2 * N_KV) * D, device=dev, dtype=bf16)
    k = qkv[:, N_HEADS * D:(N_HEADS + N_KV) * D].view(rows, N_KV, D)
    v = qkv[:, (N_HEADS + N_KV) * D:].view(rows, N_KV, D)
    slots = torch.randperm(SLOTS, device=dev)[:rows]
    out = []
    for copy in (False, True):
        dtypes = (bf16, bf16) + ((fp8,) if copy else ())
        pools = [torch.zeros(LAYERS, SLOTS, N_KV, D, device=dev, dtype=t) for t in dtypes]
        want = [p.clone() for p in pools]

        def index_put(layer, pools=pools):
            pools[0][layer, slots] = k
            pools[1][layer, slots] = v
            if copy:
                pools[2][layer, slots] = k.to(fp8)

        def one_launch(layer, pools=pools):
            pairs = [(k, pools[0][layer]), (v, pools[1][layer])]
            scatter_rows(pairs + ([(k.to(fp8), pools[2][layer])] if copy else []), slots)

        index_put(0, want)
        one_launch(0)
        assert all(torch.equal(a[0].view(torch.uint8), b[0].view(torch.uint8)) for a, b in zip(pools, want))
        label = "K, V and the fp8 copy" if copy else "K and V"
        for name, fn in ((f"index_put per pool ({label})", index_put), (f"scatter_rows ({label})", one_launch)):
            us = graph_us(fn, LAYERS, REPLAYS)
            out.append({"op": "kv write", "rows": rows, "variant": name, "graph_us": round(us, 2)})
            print(out[-1], flush=True)
    return out


def main(out: Path) -> None:
    rows = kv_write_rows(1) + kv_write_rows(512)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_write.json").write_text(json.dumps(rows, indent=1))
    lines = ["| op | rows | variant | us per layer (in a graph) |", "|---|---|---|---|"]
    lines += [f"| {r['op']} | {r['rows']} | {r['variant']} | {r['graph_us']:.2f} |" for r in rows]
    (out / "kv_write.md").write_text(f"# The KV write of one layer, {torch.cuda.get_device_name()}\n\n"
                                     + "\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, nargs="?", default=Path("."), metavar="OUTDIR",
                        help="folder the results are written to (made if missing; default the current one)")
    main(parser.parse_args().out)

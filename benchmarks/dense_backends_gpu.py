"""Which PyTorch SDPA backend is the strongest dense attention on this GPU, at the shapes the benches time: one
Llama-3-8B attention layer (32 query heads, 8 kv heads, d 128, bf16), timed per backend (flash, cuDNN, memory
efficient, and PyTorch's own choice with no backend named, as transformers runs it), each output checked against the
first row's (flash's).

    PYTHONPATH=$PWD python3 benchmarks/dense_backends_gpu.py OUTDIR

Shapes: a prefill chunk of 512 queries over 128K and 1M keys and one of 8,192 over 128K (causal, bottom-right
aligned: the chunk's queries are the last keys), a whole causal prompt in one pass (32K, 128K), a decode query
over 128K and 1M keys, 8 decode queries over 32K keys each (unmasked, and with a padding mask, which a batch
of caches of different lengths needs: cuDNN has no per-sequence key length here). A backend that refuses a mask
form is tried in the next form: the ``causal_lower_right`` bias, a boolean mask tensor, and (cuDNN, which takes
only a top-left causal flag) the chunk split in two, its context unmasked and its own c keys causal, merged by the
two parts' log-sum-exp (the benches' own ``bench.dense.causal_attention``). GQA is tried with ``enable_gqa``, then
with the kv heads repeated to 32 (the repeat not timed; the row says so). Milliseconds are medians of 10 calls
after 3 warm-up calls, timed by CUDA events. Writes OUTDIR/dense_backends.json and OUTDIR/dense_backends.md.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from tokenselect.bench.dense import causal_attention

H, KV, D = 32, 8, 128
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def median_ms(fn, reps: int = 10, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def case(name: str, batch: int, c: int, L: int, gen: torch.Generator) -> list[dict]:
    q = torch.randn(batch, H, c, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(batch, KV, L, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(batch, KV, L, D, device="cuda", dtype=torch.bfloat16, generator=gen)
    square, one = c == L, c == 1
    forms = {}  # mask form -> kwargs of F.scaled_dot_product_attention
    if one:
        forms["no mask"] = {}
        # a batch of decode queries over caches of different lengths needs a padding mask (the last 1% unused here)
        forms["padding mask"] = {"attn_mask": (torch.arange(L, device="cuda") < L - L // 100).view(1, 1, 1, L)}
    elif square:
        forms["is_causal"] = {"is_causal": True}
    else:
        forms["causal_lower_right"] = {"attn_mask": causal_lower_right(c, L)}
        forms["bool mask"] = {"attn_mask": torch.ones(c, L, dtype=torch.bool, device="cuda").tril(L - c)}
    rows, want = [], {}  # mask form -> the first backend's output (flash's)
    for backend in ("flash", "cudnn", "efficient", "default"):
        for form, kwargs in forms.items():
            for gqa in ("enable_gqa", "repeated"):
                kk, vv = (k, v) if gqa == "enable_gqa" else (k.repeat_interleave(H // KV, 1),
                                                             v.repeat_interleave(H // KV, 1))

                def run():
                    if backend == "default":
                        return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=gqa == "enable_gqa", **kwargs)
                    with sdpa_kernel(BACKENDS[backend]):
                        return F.scaled_dot_product_attention(q, kk, vv, enable_gqa=gqa == "enable_gqa", **kwargs)
                row = {"case": name, "batch": batch, "queries": c, "keys": L, "backend": backend, "mask": form,
                       "gqa": gqa}
                try:
                    out = run()
                    torch.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 - a backend that refuses the shape is a row, not a failure
                    rows.append({**row, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"})
                    del kk, vv
                    continue
                want.setdefault(form, out)
                row["max_abs_diff_vs_first"] = float((out.float() - want[form].float()).abs().max())
                del out
                row["ms"] = round(median_ms(run), 3)
                rows.append(row)
                print(json.dumps(row), flush=True)
                del kk, vv
                torch.cuda.empty_cache()
                if gqa == "enable_gqa" and "error" not in row:
                    break  # GQA taken as it is: no need to time the repeated heads
    if not one and not square:
        for gqa in ("enable_gqa", "repeated"):
            kk, vv = ((k, v) if gqa == "enable_gqa"
                      else (k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)))
            row = {"case": name, "batch": batch, "queries": c, "keys": L, "backend": "cudnn",
                   "mask": "split, lse merge", "gqa": gqa}
            try:
                out = causal_attention(q, kk, vv, "cudnn")
                torch.cuda.synchronize()
                row["max_abs_diff_vs_first"] = float((out.float() - want["causal_lower_right"].float()).abs().max())
                row["ms"] = round(median_ms(lambda: causal_attention(q, kk, vv, "cudnn")), 3)
                print(json.dumps(row), flush=True)
            except Exception as e:  # noqa: BLE001
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            rows.append(row)
            del kk, vv
            torch.cuda.empty_cache()
            if "error" not in row:
                break
    return rows


def main(out: str) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, batch, c, L in (("chunk 512 @ 128K", 1, 512, 1 << 17), ("chunk 512 @ 1M", 1, 512, 1 << 20),
                              ("chunk 8192 @ 128K", 1, 8192, 1 << 17), ("one pass 32K", 1, 1 << 15, 1 << 15),
                              ("one pass 128K", 1, 1 << 17, 1 << 17), ("decode @ 128K", 1, 1, 1 << 17),
                              ("decode @ 1M", 1, 1, 1 << 20), ("decode 8 x 32K", 8, 1, 1 << 15)):
        rows += case(name, batch, c, L, gen)
        torch.cuda.empty_cache()
    Path(out).mkdir(parents=True, exist_ok=True)
    (Path(out) / "dense_backends.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
         "cudnn": torch.backends.cudnn.version(), "rows": rows}, indent=1))
    lines = [f"# Dense SDPA backends, one Llama-3-8B attention layer, {torch.cuda.get_device_name(0)} "
             f"(torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()})", "",
             "| case | backend | mask | GQA | ms | max abs diff vs the first backend run with that mask | error |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['backend']} | {r['mask']} | {r['gqa']} | {r.get('ms', '')} | "
                     f"{r.get('max_abs_diff_vs_first', '')} | {r.get('error', '')} |")
    (Path(out) / "dense_backends.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", metavar="OUTDIR", help="folder the results are written to (made if missing)")
    main(parser.parse_args().out)

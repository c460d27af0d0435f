"""An engine's first requests with and without ``LLM.warm_up`` (what ``tokenselect serve --warm-up-tokens N`` runs
before it listens; issue #28: the first question after a start waited for Triton's compiles, 9.45 s against 4 s for
the next in the bench).

For each setting, a fresh process (an engine of the model given, or the shipped one, at its defaults) on an empty
Triton cache (``TRITON_CACHE_DIR``): the seconds to build the engine and to warm it up, then requests of token-id
prompts of ragged lengths (near the warm-up's, or near ``--request-tokens``), one after another, each timed to its
answer with ``max_tokens`` 1 (its time to first token: the prefill's; ``--max-tokens`` for decode steps too), then
a second round of the same lengths (compiled by then: what a warmed engine should show from the first). No HTTP:
the server's warm-up is this call (the device machine has no web stack: uvicorn).

    PYTHONPATH=$PWD python3 benchmarks/warm_up_first_requests_gpu.py OUTDIR [--tokens N] [--request-tokens N]
        [--warm-ups N,N,..] [--max-tokens N] [--model M] [--device cuda]

Writes OUTDIR/warm_up_first_requests.{json,md}.
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(args) -> None:
    """In a fresh process: build, warm up (or not), time the requests; print the row as JSON."""
    from first_prefill_compiles_gpu import logged_compiles  # benchmarks/, beside this script (run as a script)

    phase = ["warm-up"]  # the engine's build counts as the warm-up's
    with logged_compiles(phase) as compiles:
        row = timed_requests(args, phase, compiles)
    print(json.dumps(row), flush=True)


def timed_requests(args, phase: list[str], compiles: list[dict]) -> dict:
    """Build the engine, warm it up (or not) and time the requests, each naming the compiles inside it."""
    import torch

    from tokenselect import LLM, SamplingParams

    from first_prefill_compiles_gpu import changed_args

    started = time.perf_counter()
    llm = LLM(args.model, device=args.device)
    row = {"warm_up_tokens": args.warm_up, "build_s": round(time.perf_counter() - started, 2), "requests": []}
    started = time.perf_counter()
    rng = random.Random(0)
    vocab = min(8000, llm.config.vocab_size)
    if args.warm_up:  # its ids do not matter to what compiles (the server's are the vocabulary's in turn)
        llm.warm_up([rng.randrange(100, vocab) for _ in range(args.warm_up)])
    if args.device == "cuda":
        torch.cuda.synchronize()
    row["warm_up_s"] = round(time.perf_counter() - started, 2)
    n = args.request_tokens or args.tokens
    lengths = [n - 5, n * 3 // 4 - 3, n // 2 + 7]
    for round_ in (1, 2):
        for n in lengths:
            prompt = [rng.randrange(100, vocab) for _ in range(n)]
            phase[0] = f"round {round_}: {n}"
            t = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True))
            seconds = round(time.perf_counter() - t, 3)
            named = [f"{c['kernel']} {c['seconds']:.2f} s ({', '.join(changed_args(c, compiles)) or 'new'})"
                     for c in compiles if c["phase"] == phase[0]]
            row["requests"].append({"round": round_, "tokens": n, "seconds": seconds, "compiles": named})
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("output", type=Path)
    ap.add_argument("--tokens", type=int, default=32768, help="the warm-up prompt's length (default 32768)")
    ap.add_argument("--request-tokens", type=int, default=None,
                    help="the longest request's length, about (default: --tokens); the others 3/4 and 1/2 of it")
    ap.add_argument("--warm-ups", default=None,
                    help="comma-separated warm-up lengths to compare (default: 0 and --tokens)")
    ap.add_argument("--max-tokens", type=int, default=1,
                    help="tokens each request generates (default 1: its time to first token; more: its decode too)")
    ap.add_argument("--model", default=None, help="default: the shipped model")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--warm-up", type=int, default=None, help=argparse.SUPPRESS)  # set in the child processes
    args = ap.parse_args(argv)
    if args.warm_up is not None:
        return child(args)
    rows = []
    warm_ups = [int(w) for w in args.warm_ups.split(",")] if args.warm_ups else [0, args.tokens]
    for warm_up in warm_ups:
        root = str(Path(__file__).resolve().parent.parent)  # this tree's tokenselect, whatever is installed
        env = {**os.environ, "TRITON_CACHE_DIR": tempfile.mkdtemp(prefix="triton_"),
               "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        command = [sys.executable, __file__, str(args.output), "--tokens", str(args.tokens), "--device", args.device,
                   "--warm-up", str(warm_up), "--request-tokens", str(args.request_tokens or args.tokens),
                   "--max-tokens", str(args.max_tokens)]
        command += ["--model", args.model] if args.model else []
        done = subprocess.run(command, env=env, stdout=subprocess.PIPE, text=True, check=True)
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    args.output.mkdir(parents=True, exist_ok=True)
    (args.output / "warm_up_first_requests.json").write_text(json.dumps(
        {"tokens": args.tokens, "request_tokens": args.request_tokens or args.tokens, "max_tokens": args.max_tokens,
         "model": args.model, "device": args.device, "rows": rows}, indent=1))
    lines = ["| warm-up tokens | engine built s | warm-up s | " + " | ".join(
        f"round {r['round']}: {r['tokens']} tokens s" for r in rows[0]["requests"]) + " |",
        "|---|---|---|" + "---|" * len(rows[0]["requests"])]
    for row in rows:
        lines.append(f"| {row['warm_up_tokens']} | {row['build_s']} | {row['warm_up_s']} | "
                     + " | ".join(str(r["seconds"]) for r in row["requests"]) + " |")
    lines += ["", "| warm-up tokens | request | kernels compiled in it (seconds; arguments specialized otherwise than "
              "in the warm-up's nearest variant) |", "|---|---|---|"]
    lines += [f"| {row['warm_up_tokens']} | round {r['round']}: {r['tokens']} | {'; '.join(r['compiles'])} |"
              for row in rows for r in row["requests"] if r["compiles"]]
    (args.output / "warm_up_first_requests.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""Where an engine's peak GPU memory comes from: for each selection-keys setting, one engine of the Llama-3-8B shape
(random weights) runs ``bench e2e``'s warm-up, then prefills and decodes one prompt under PyTorch's allocator history;
the tensors alive at the peak are summed by the line of our code that allocated them.

Asked by `bench throughput`'s 32K table: TokenSelect with an fp8 copy of the keys peaked 14 GB above the same pool's
bytes with bf16 keys (87.4 GB against 73.3), and `bench e2e` at 128K 4.5 GB above (of which the copy is 1.1).

Usage (on a GPU): PYTHONPATH=$PWD python3 benchmarks/memory_peak_gpu.py OUTDIR [LENGTH] [--select-dtype kv,fp8]
Writes OUTDIR/memory_peak.{json,md}.
"""
import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import torch

from tokenselect.bench.e2e import CONFIGS, free_memory, measure, text_prompt, warm_up
from tokenselect.eval.runner import parse_length
from tokenselect.engine import LLM


def ours(frames: list[dict]) -> str:
    """The innermost frame in tokenselect/ of an allocation's stack (``file:line function``)."""
    for f in frames:
        if "tokenselect/" in f["filename"]:
            return f"{f['filename'].split('tokenselect/')[-1]}:{f['line']} {f['name']}"
    return frames[0]["filename"] + ":" + str(frames[0]["line"]) if frames else "?"


def live_at_peak(snapshot: dict) -> tuple[int, Counter]:
    """Replay the allocator's trace: the most bytes alive at once (of what the trace saw), and those bytes by the
    line that allocated them."""
    events = [e for trace in snapshot["device_traces"] for e in trace]

    def replay(stop: int | None) -> tuple[int, int, dict]:
        live, total, peak, peak_at = {}, 0, 0, 0
        for i, e in enumerate(events[:stop]):
            if e["action"] == "alloc":
                live[e["addr"]] = e
                total += e["size"]
                if total > peak:
                    peak, peak_at = total, i + 1
            elif e["action"] == "free_completed" and e["addr"] in live:
                total -= live.pop(e["addr"])["size"]
        return peak, peak_at, live

    peak, peak_at, _ = replay(None)
    at_peak: Counter = Counter()
    for e in replay(peak_at)[2].values():
        at_peak[ours(e.get("frames", []))] += e["size"]
    return peak, at_peak


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("output", type=Path)
    ap.add_argument("length", nargs="?", default="64k", type=parse_length)
    ap.add_argument("--select-dtype", default="kv,fp8")
    ap.add_argument("--policy", default="tokenselect")
    args = ap.parse_args(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    config = CONFIGS["llama3-8b"]
    ids = text_prompt(args.length, config["vocab_size"])
    runs, lines = [], [f"# Peak GPU memory by allocating line, {args.length} tokens, {args.policy}, "
                       f"{torch.cuda.get_device_name()}", ""]
    for select in args.select_dtype.split(","):
        llm = LLM.random(config, args.policy, device="cuda", kv_cache_tokens=args.length + 64, prefix_cache=False,
                         select_dtype=select)
        built = torch.cuda.memory_allocated() / 1e9
        warm_up(llm, ids)
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=2_000_000)
        row = measure(llm, ids, 8)
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        peak, at_peak = live_at_peak(snapshot)
        run = {"select_dtype": select, "built_gb": built, "peak_gb": row["peak_gb"], "prefill_s": row["prefill_s"],
               "traced_peak_gb": peak / 1e9, "at_peak_gb": {k: v / 1e9 for k, v in at_peak.most_common(25)}}
        runs.append(run)
        print(json.dumps(run, indent=1), flush=True)
        lines += [f"## select_dtype={select}: {built:.1f} GB after the engine's start, peak {row['peak_gb']:.1f} GB; "
                  f"{peak / 1e9:.2f} GB allocated in the measured request at its peak", "",
                  "| allocated at | GB |", "|---|---|"]
        lines += [f"| `{k}` | {v / 1e9:.3f} |" for k, v in at_peak.most_common(25)] + [""]
        llm.close()
        del llm
        free_memory()
    (args.output / "memory_peak.json").write_text(json.dumps(runs, indent=1))
    (args.output / "memory_peak.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())

"""A fresh engine's first requests when attention runs outside CUDA graphs (a server's steps that batch several
sequences run their layers as graphs around eager attention): how many cuDNN plans each request builds, and its
prefill time, for the tree on PYTHONPATH.

Written to measure a candidate that admitted a shape only once a later forward pass met it again (dropped:
results/supporting/plan_budget_h200.md). Every prompt ends in a 320-query chunk (a multiple of 64, so cuDNN may
take it). What it showed: full attention builds no plan at all (its lists carry a live length, which the Triton
kernel serves); TokenSelect two or three (its selecting chunks' shape, the ragged chunk's and, first come,
a shape its warm-up met once). The engine is started and warmed up as ``tokenselect serve`` does on a GPU
(``LLM.default_warm_up_tokens``), then serves the prompts one at a time; each request's row says the plans the
engine's cuDNN budget held after it (``PlanBudget.shapes``) and its prefill time (one generated token; CUDA
synchronized).

Usage (device): PYTHONPATH=<tree> python3 benchmarks/plan_budget_gpu.py OUT.json [--tag NAME]
               python3 benchmarks/plan_budget_gpu.py --table BEFORE.json AFTER.json > table.md
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tokenselect.bench.e2e import CONFIGS, cudnn_budget, text_prompt
from tokenselect.engine import LLM
from tokenselect.sampling import SamplingParams

LENGTHS = (16 * 1024 + 320, 20 * 1024 + 320, 16 * 1024 + 320, 24 * 1024 + 320, 20 * 1024 + 320)


def table(paths: list[Path]) -> str:
    """The runs side by side, a row a request."""
    runs = [json.loads(path.read_text()) for path in paths]
    head = " | ".join(f"{r['tag']} plans | {r['tag']} s" for r in runs)
    lines = [f"# cuDNN plans a fresh engine builds: {runs[0]['policy']}, llama3-8b, chunk {runs[0]['chunk']}, "
             f"eager attention, {runs[0]['device']}", "",
             "; ".join(f"{r['tag']}: a shape admitted after {r['seen_before']} sightings, at most {r['limit']}"
                       for r in runs), "",
             f"| request | tokens | {head} |", "|---|---|" + "---|---|" * len(runs)]
    for i, row in enumerate(runs[0]["rows"]):
        cells = " | ".join(f"{r['rows'][i]['plans']} | {r['rows'][i]['seconds']:.2f}" for r in runs)
        lines.append(f"| {row['request']} | {row['tokens']:,} | {cells} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("output", type=Path, nargs="?")
    p.add_argument("--tag", default="")
    p.add_argument("--policy", default="full")
    p.add_argument("--table", nargs="+", type=Path, help="runs' JSON files: print their table")
    args = p.parse_args()
    if args.table:
        print(table(args.table), end="")
        return
    if args.output is None:
        p.error("give OUT.json, or --table with runs' JSON files")
    config = CONFIGS["llama3-8b"]
    llm = LLM.random(config, args.policy, cuda_graphs=False, prefix_cache=False,
                     kv_cache_tokens=max(LENGTHS) + 64)
    budget = cudnn_budget(llm)
    if budget is None:
        raise SystemExit("this engine's chunks run on the Triton kernel alone: a Hopper GPU in bf16 is needed")
    ids = text_prompt(max(LENGTHS) + 4096, config["vocab_size"])
    start = time.perf_counter()
    llm.warm_up(ids[-llm.default_warm_up_tokens():])
    rows = [{"request": "warm-up", "tokens": llm.default_warm_up_tokens(), "plans": len(budget.shapes),
             "seconds": time.perf_counter() - start}]
    for i, n in enumerate(LENGTHS):
        prompt = ids[i * 512:i * 512 + n]  # each prompt's own tokens (no prefix cache either way)
        torch.cuda.synchronize()
        start = time.perf_counter()
        llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        torch.cuda.synchronize()
        rows.append({"request": i + 1, "tokens": n, "plans": len(budget.shapes),
                     "seconds": time.perf_counter() - start})
        print(rows[-1], flush=True)
    result = {"tag": args.tag, "policy": args.policy, "chunk": llm.chunk_size, "layers": llm.model.config.n_layers,
              "seen_before": getattr(budget, "seen_before", 0), "limit": budget.limit,
              "device": torch.cuda.get_device_name(), "rows": rows}
    args.output.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

"""Why an engine's first TokenSelect row prefills 128K slower than the next one (issue #28's notes: 5.11-5.41 s
against 4.54-4.68 s): the Triton kernel variants compiled after ``bench e2e``'s warm-up, and when.

One engine of the Llama-3-8B shape (random weights) with TokenSelect; the bench's own warm-up; then the same
prompt measured ``--repeats`` times. Triton's ``jit_cache_hook`` and ``jit_post_compile_hook`` log every kernel
variant compiled (its name, the specialization of its arguments, the seconds it took) under the phase that met it.

Usage (on a GPU): PYTHONPATH=$PWD python3 benchmarks/first_prefill_compiles_gpu.py OUTDIR [LENGTH] [--repeats N]
Writes OUTDIR/first_prefill_compiles.{json,md}.
"""
import argparse
import contextlib
import json
import re
import sys
import time
from pathlib import Path

import torch
from triton import knobs

from tokenselect.bench.e2e import CONFIGS, measure, text_prompt, warm_up
from tokenselect.bench.floors import sync
from tokenselect.engine import LLM
from tokenselect.eval.runner import parse_length


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("output", type=Path)
    ap.add_argument("length", nargs="?", default="128k", type=parse_length)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--policy", default="tokenselect")
    ap.add_argument("--config", default="llama3-8b", choices=sorted(CONFIGS))
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    phase = ["start"]
    with logged_compiles(phase) as compiles:
        phases = run(args, phase, compiles)
    gpu = torch.cuda.get_device_name() if torch.device(args.device).type == "cuda" else "cpu"
    write(args, gpu, phases, compiles)


@contextlib.contextmanager
def logged_compiles(phase: list[str]):
    """Inside the block, every kernel variant Triton compiles is appended to the list yielded: the phase it ended
    in (``phase[0]`` then), its kernel, seconds, variant, key and argument names. Triton's hooks are the process's:
    they are restored after, so that a caller (a test) does not log into this list later."""
    started: dict = {}
    compiles: list[dict] = []

    def on_miss(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        started[str(key)] = time.perf_counter()
        return False

    def on_compiled(*, key, repr, fn, compile, is_manual_warmup, already_compiled):
        took = time.perf_counter() - started.pop(str(key), time.perf_counter())
        compiles.append({"phase": phase[0], "kernel": fn.name, "seconds": took, "variant": repr,
                         "key": str(key), "attrs": str(compile.get("configs")),
                         "arg_names": list(getattr(getattr(fn, "jit_function", fn), "arg_names", []))})
        print(f"  [{phase[0]}] compiled {fn.name} in {took:.2f} s", flush=True)

    hooks = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = on_miss, on_compiled
    try:
        yield compiles
    finally:
        knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook = hooks


def run(args: argparse.Namespace, phase: list[str], compiles: list[dict]) -> list[dict]:
    """The warm-up and the timed prefills, each a phase (``phase[0]`` names the one running, for the hooks)."""
    config = CONFIGS[args.config]
    llm = LLM.random(config, args.policy, device=args.device, kv_cache_tokens=args.length + 64, prefix_cache=False)
    ids = text_prompt(args.length, config["vocab_size"])
    phases = []
    for name in ["warm-up"] + [f"timed {i + 1}" for i in range(args.repeats)]:
        phase[0] = name
        sync(llm.device)
        start = time.perf_counter()
        row = warm_up(llm, ids) if name == "warm-up" else measure(llm, ids, 4)
        took = time.perf_counter() - start
        mine = [c for c in compiles if c["phase"] == name]
        phases.append({"phase": name, "seconds": took, "prefill_s": row and row["prefill_s"],
                       "compiles": len(mine), "compile_s": sum(c["seconds"] for c in mine)})
        print(json.dumps(phases[-1]), flush=True)
    return phases


def arg_specs(key: str) -> list[str]:
    """A compile's key, "[('*fp32', 'D'), ('i32', ''), ('constexpr', 128), ...]{options}", as one string an
    argument (its type and specialization: 'D' divisible by 16, '' not)."""
    return re.findall(r"\((.*?)\)(?:, |\]$)", key[:key.index("]{") + 1])


def changed_args(compile: dict, compiles: list[dict]) -> list[str]:
    """The arguments (name: specialization) in which ``compile`` differs from the warm-up's nearest variant of the
    same kernel (the fewest differing arguments); [] when the warm-up compiled no variant of it."""
    mine = arg_specs(compile["key"])
    diffs = [[i for i, (a, b) in enumerate(zip(mine, arg_specs(c["key"]))) if a != b] for c in compiles
             if c["phase"] == "warm-up" and c["kernel"] == compile["kernel"]]
    names = compile.get("arg_names") or []
    return [f"{names[i] if i < len(names) else i}: ({mine[i]})" for i in min(diffs, key=len, default=[])]


def write(args: argparse.Namespace, gpu: str, phases: list[dict], compiles: list[dict]) -> None:
    """OUTDIR/first_prefill_compiles.{json,md}."""
    result = {"length": args.length, "policy": args.policy, "gpu": gpu, "phases": phases, "compiles": compiles}
    (args.output / "first_prefill_compiles.json").write_text(json.dumps(result, indent=1))
    lines = [f"# Kernel variants compiled after the warm-up, {args.length} tokens, {args.policy}, "
             f"{result['gpu']}", "", "| phase | wall s | prefill s | compiles | compile s |", "|---|---|---|---|---|"]
    lines += [f"| {p['phase']} | {p['seconds']:.2f} | {p['prefill_s'] or 0:.2f} | {p['compiles']} | "
              f"{p['compile_s']:.2f} |" for p in phases]
    lines += ["", "| phase | kernel | s | arguments specialized otherwise than in the warm-up |", "|---|---|---|---|"]
    lines += [f"| {c['phase']} | {c['kernel']} | {c['seconds']:.2f} | {', '.join(changed_args(c, compiles)) or '?'} |"
              for c in compiles if c["phase"] != "warm-up"]
    (args.output / "first_prefill_compiles.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())

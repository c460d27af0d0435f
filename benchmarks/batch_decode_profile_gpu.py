"""Where a batched decode step's time goes: B requests of L tokens decoded together by TokenSelect (every layer
selecting, and every layer a Selection Cache hit with theta=-1), under torch.profiler, each part against its memory
floor, beside one request of B x L tokens (the same keys to score, one sequence).

    PYTHONPATH=$PWD python3 benchmarks/batch_decode_profile_gpu.py OUTDIR [--batch 8 --length 32k]

Issue #28 asks for 8 x 32K decode at >= 3x dense's tokens/s; ``results/throughput_32k_h200.md`` has the selecting
step at 11.09 ms (1.31x) where its floor allows about 2.4x. This script says which kernels hold the step: the engine
and prompts are ``bench throughput``'s (random Llama-3-8B-shape weights, prose prompts, requests prefilled one at a
time, ``prefill_held``), the parts and floors ``bench e2e --profile-steps``'s (``floors.profile_parts``), the floor of
B sequences the weights once and B sequences' scoring and attention. Writes OUTDIR/batch_decode_profile.{md,json}.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from tokenselect.bench import e2e, throughput
from tokenselect.bench.floors import copy_bandwidth, decode_floor, profile_parts, timed
from tokenselect.engine import LLM
from tokenselect.eval.runner import parse_length
from tokenselect.policies import policy_spec
from tokenselect.sampling import SamplingParams

POLICIES = ("tokenselect", "tokenselect:theta=-1")


def profile_steps(llm: LLM, steps: int) -> tuple[list, int]:
    """``steps`` engine steps under torch.profiler (``bench e2e``'s ``profiled``) -> (its kernels' times,
    ``floors.kernel_times``, and the passes that ran in the window); none on a CPU, where no device kernel runs."""
    left = iter(range(steps))
    seen: dict = {"events": [], "passes": steps}

    def keep(events, passes: int) -> str:  # profiled's table by part, called on CUDA: here it keeps what it is given
        seen.update(events=events, passes=passes)
        return ""
    e2e.profiled(llm, lambda: next(left, None) is None, keep)
    return seen["events"], seen["passes"]


def measure(llm: LLM, config: dict, policy: str, batch: int, length: int, args, bandwidth: float) -> dict:
    """Prefill ``batch`` prompts of ``length`` tokens, time ``args.steps`` decode steps, then profile
    ``args.profile_steps`` more -> the row (with its parts table and the top kernels)."""
    name, settings = policy_spec(policy)
    llm.set_attention(name, **settings)
    max_tokens = 2 + args.steps + args.profile_steps + 4
    e2e.warm_up(llm, throughput.prompts(1, min(length, 40_000), config["vocab_size"])[0])
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    seqs = throughput.prefill_held(llm, throughput.prompts(batch, length, config["vocab_size"]), params)
    try:
        for _ in range(throughput.UNTIMED_STEPS):
            llm.step()
        before = llm.policy.stats()
        tokens, seconds = timed(llm.device, lambda: sum(len(llm.step()) for _ in range(args.steps)))
        counted = llm.policy.stats() - before
        events, passes = profile_steps(llm, args.profile_steps)
    finally:
        for seq in seqs:
            if not seq.finished:
                llm.abort(seq)
    looked_up = counted.selection_cache_hits + counted.selection_cache_misses
    hit_rate = counted.selection_cache_hits / looked_up if looked_up else 0.0
    select_bytes = llm.select_dtype.itemsize
    floor = decode_floor(config, llm.policy_config, length, bandwidth, select_bytes=select_bytes, hit_rate=hit_rate,
                         batch=batch)
    kernels = [(e.key, e.self_device_time_total / 1e3 / passes) for e in events]  # floors.kernel_times: kernels only
    kernels.sort(key=lambda kv: -kv[1])
    row = {"policy": policy, "batch": batch, "length": length, "ms_step": seconds / args.steps * 1e3,
           "tokens": tokens, "hit_rate": hit_rate, "floor_ms": floor["floor_ms"], "profiled_passes": passes,
           "parts": profile_parts(events, passes, floor, bandwidth) if kernels else "(no device kernels: a CPU run)",
           "kernels": [(key, round(ms, 4)) for key, ms in kernels[:25]]}
    print(f"{policy} {batch} x {length}: {row['ms_step']:.2f} ms a step, floor {floor['floor_ms']:.2f} ms, hit rate "
          f"{hit_rate:.0%}\n{row['parts']}", flush=True)
    return row


def report(rows: list[dict], title: str) -> str:
    lines = [f"# {title}", "", "| policy | batch x tokens | ms a step | floor ms | of floor | SC hit rate |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['policy']} | {r['batch']} x {r['length']:,} | {r['ms_step']:.2f} | {r['floor_ms']:.2f} | "
                     f"{r['floor_ms'] / r['ms_step']:.0%} | {r['hit_rate']:.0%} |")
    for r in rows:
        lines += ["", f"## {r['policy']}, {r['batch']} x {r['length']:,} ({r['profiled_passes']} profiled passes)", "",
                  r["parts"], "", "| kernel | device ms a step |", "|---|---|"]
        lines += [f"| `{key[:90]}` | {ms:.3f} |" for key, ms in r["kernels"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="folder for batch_decode_profile.{md,json}")
    e2e.add_model_arguments(p)
    p.add_argument("--batch", type=int, default=8, help="requests decoded together")
    p.add_argument("--length", default="32k", help="prompt tokens of each request")
    p.add_argument("--single", action=argparse.BooleanOptionalAction, default=True,
                   help="also one request of batch x length tokens")
    p.add_argument("--steps", type=int, default=16, help="timed decode steps")
    p.add_argument("--profile-steps", type=int, default=4, help="decode steps under the profiler")
    p.add_argument("--kv-cache-tokens", type=int, default=344_000,
                   help="the engine's pool (344,000: bench throughput's TokenSelect pool in 430,000 tokens' bytes)")
    p.add_argument("--device", default=None)
    args = p.parse_args()
    config = e2e.model_config(args)
    length = parse_length(args.length)
    llm = LLM.random(config, "tokenselect", device=args.device, kv_cache_tokens=args.kv_cache_tokens,
                     prefix_cache=False)
    bandwidth = copy_bandwidth(llm.device)
    shapes = [(args.batch, length)] + ([(1, args.batch * length)] if args.single and args.batch > 1 else [])
    rows = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name() if llm.device.type == "cuda" else "cpu"
    title = (f"Batched decode by part: {args.config}, {config['num_hidden_layers']} layers, copy bandwidth "
             f"{bandwidth / 1e9:,.0f} GB/s, on {device}")
    for batch, tokens in shapes:
        for policy in POLICIES:
            rows.append(measure(llm, config, policy, batch, tokens, args, bandwidth))
            (out / "batch_decode_profile.md").write_text(report(rows, title))
            (out / "batch_decode_profile.json").write_text(json.dumps({"title": title, "rows": rows}, indent=1))
    print(report(rows, title))


if __name__ == "__main__":
    main()

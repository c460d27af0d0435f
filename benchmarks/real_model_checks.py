"""Two checks of the attention policies on a real model, beside the task tables of ``tokenselect eval``:

1. No harm inside the window: on English prose of 1/4, 1/2 and 1x the model's window, the share of the last
   ``--positions`` prompt positions where a policy's most likely next token equals full attention's (top-1
   agreement; full attention agrees with itself at 100%). Every selective policy runs twice: with its default
   ``dense_until`` (the model's window) and with ``dense_until=0`` (the paper: select past sinks + budget + window).
2. The Selection Cache on real prose: TokenSelect decodes ``--decode`` greedy tokens after a prose prompt of
   ``--prose-length`` tokens, at each ``--thetas`` value; the hit rate is over every layer of every step.

Both run on one engine started with full attention, so the selective policies score the KV pool's own keys, not
TokenSelect's default fp8 copy on a GPU (``engine.selection_keys_dtype``; the copy moves the hit rate by under a
point on the task prompts, ``results/supporting/fp8_keys_real_models_h200.md``).

    python benchmarks/real_model_checks.py --model smollm2-135m-instruct --out OUT

Writes OUT/real_model_checks.json and OUT/real_model_checks.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from tokenselect import LLM, SamplingParams
from tokenselect.data import prose_text
from tokenselect.policies import policy_spec

POLICIES = [f"{name}{variant}" for name in ("tokenselect", "streaming", "infllm", "quest", "reattention")
            for variant in ("", ":dense_until=0")]


def prose_ids(llm: LLM, n: int, offset: int = 0) -> list[int]:
    """``n`` tokens of the shipped prose, from character ``offset``."""
    text = prose_text()
    ids = llm.encode(text[offset:offset + 8 * n])
    while len(ids) < n:  # short of tokens: more text
        ids = llm.encode(text[offset:offset + 16 * n])
    return ids[:n]


def agreement(llm: LLM, lengths: list[int], positions: int, policies: list[str]) -> list[dict]:
    rows = []
    for length in lengths:
        ids = prose_ids(llm, length)
        llm.set_attention("full")
        reference = llm.prompt_logits(ids)[-positions:].argmax(-1)
        for spec in policies:
            name, settings = policy_spec(spec)
            llm.set_attention(name, **settings)
            start = time.perf_counter()
            top1 = llm.prompt_logits(ids)[-positions:].argmax(-1)
            rows.append({"length": length, "policy": spec, "positions": positions,
                         "top1_agreement": round((top1 == reference).float().mean().item() * 100, 2),
                         "seconds": round(time.perf_counter() - start, 2)})
            print(rows[-1], flush=True)
    llm.set_attention("full")
    return rows


def hit_rates(llm: LLM, length: int, decode: int, thetas: list[float]) -> list[dict]:
    ids = prose_ids(llm, length, offset=len(prose_text()) // 3)
    rows = []
    for theta in thetas:
        llm.set_attention("tokenselect", theta=theta)
        start = time.perf_counter()
        llm.generate([ids], SamplingParams(max_tokens=decode, temperature=0, ignore_eos=True))
        stats = llm.stats()
        rows.append({"prompt_tokens": length, "decoded": decode, "theta": theta,
                     "hit_rate": round(stats["selection_cache_hit_rate"] * 100, 2),
                     "lookups": stats["selection_cache_hits"] + stats["selection_cache_misses"],
                     "seconds": round(time.perf_counter() - start, 2)})
        print(rows[-1], flush=True)
    llm.set_attention("full")
    return rows


def markdown(model: str, device: str, agree: list[dict], hits: list[dict], args) -> str:
    lines = [f"# Real-model checks: {model}, on {device}", "",
             f"## Top-1 agreement with full attention inside the window (last {agree[0]['positions']} prompt positions "
             "of English prose, %)", ""]
    lengths = list(dict.fromkeys(r["length"] for r in agree))
    policies = list(dict.fromkeys(r["policy"] for r in agree))
    lines += ["| policy | " + " | ".join(f"{n} tokens" for n in lengths) + " |",
              "|---|" + "---|" * len(lengths)]
    for p in policies:
        cells = [next(r["top1_agreement"] for r in agree if r["policy"] == p and r["length"] == n) for n in lengths]
        lines.append(f"| {p} | " + " | ".join(f"{c:.1f}" for c in cells) + " |")
    lines += ["", f"## Selection Cache on real prose ({hits[0]['prompt_tokens'] if hits else 0}-token prompt, "
                  f"{args.decode} greedy tokens decoded)", "", "| theta | hit rate | lookups |", "|---|---|---|"]
    lines += [f"| {r['theta']} | {r['hit_rate']:.1f}% | {r['lookups']} |" for r in hits]
    lines += ["", f"Command: `python benchmarks/real_model_checks.py {' '.join(args.argv)}`", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--positions", type=int, default=1000)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--prose-length", default="4x", help="prompt of the hit-rate check: tokens or window multiples")
    p.add_argument("--decode", type=int, default=256)
    p.add_argument("--thetas", default="0.9,0.8,0.7")
    p.add_argument("--device", default=None)
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="the KV pool (default: sized by the free memory; give it where other processes share the GPU)")
    args = p.parse_args(argv)
    args.argv = argv if argv is not None else __import__("sys").argv[1:]
    llm = LLM(args.model, device=args.device, kv_cache_tokens=args.kv_cache_tokens)
    w = llm.window
    lengths = [w // 4, w // 2, w]
    prose = int(args.prose_length[:-1]) * w if args.prose_length.endswith("x") else int(args.prose_length)
    agree = agreement(llm, lengths, min(args.positions, w // 8), args.policies.split(","))
    hits = hit_rates(llm, prose, args.decode, [float(t) for t in args.thetas.split(",")])
    device = torch.cuda.get_device_name() if llm.device.type == "cuda" else "CPU"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "real_model_checks.json").write_text(json.dumps({"model": str(llm.path), "device": device,
                                                                 "agreement": agree, "hit_rates": hits}, indent=1))
    text = markdown(Path(str(llm.path)).name, device, agree, hits, args)
    (args.out / "real_model_checks.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()

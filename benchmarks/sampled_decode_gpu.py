"""Decode steps of greedy and of sampled requests (temperature 0.8, top-p 0.95, no seed), with and without
``overlap_decode``, on one engine: whether a sampled request's steps run ahead of the host as a greedy one's do.

    python3 benchmarks/sampled_decode_gpu.py OUTDIR [LENGTH]   (GPU; Llama-3-8B shape, random bf16 weights,
                                                                TokenSelect, LENGTH prose tokens, default 32768)

Writes OUTDIR/sampled_decode.md: ms a decode step (32 timed steps after 2 untimed ones) for each of the four runs.
A seeded request is not in the table: its tokens come from its own host generator, so its steps wait for the host.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import torch

from tokenselect import LLM, SamplingParams
from tokenselect.bench import e2e

STEPS = 32


def decode_ms(llm: LLM, ids: list[int], params: SamplingParams) -> float:
    """Prefill ``ids``, then the ms a decode step over STEPS steps (each window one pass a step: the request takes
    a token more than the steps read, and the window's last step queues it)."""
    seq = llm.add_request(ids, dataclasses.replace(params, max_tokens=STEPS + 4, ignore_eos=True))
    while len(seq.output_ids) < 3:  # the prefill's token, then two untimed steps (the first records the graph)
        llm.step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    while len(seq.output_ids) < 3 + STEPS:
        llm.step()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    llm.abort(seq)
    return seconds / STEPS * 1e3


def main(out: Path, length: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    llm = LLM.random(e2e.CONFIGS["llama3-8b"], "tokenselect", prefix_cache=False)
    ids = e2e.text_prompt(length, llm.config.vocab_size)
    e2e.warm_up(llm, ids)
    runs = {"greedy": SamplingParams(temperature=0), "sampled": SamplingParams(temperature=0.8, top_p=0.95)}
    lines = [f"# Decode steps of greedy and sampled requests, {length} tokens, TokenSelect, Llama-3-8B shape, "
             f"{torch.cuda.get_device_name()}", "", "| request | overlap_decode | ms a step | passes queued ahead |",
             "|---|---|---|---|"]
    for overlap in (True, False):
        llm.settings = dataclasses.replace(llm.settings, overlap_decode=overlap)
        for name, params in runs.items():
            ahead, real = [0], llm.runner.logits

            def counted(chunks, tokens, *rest, real=real, ahead=ahead):
                ahead[0] += isinstance(tokens, torch.Tensor)
                return real(chunks, tokens, *rest)

            llm.runner.logits = counted
            ms = decode_ms(llm, ids, params)
            llm.runner.logits = real
            lines.append(f"| {name} | {'on' if overlap else 'off'} | {ms:.2f} | {ahead[0]} |")
            print(lines[-1], flush=True)
    (out / "sampled_decode.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, metavar="OUTDIR", help="folder the results are written to (made if missing)")
    parser.add_argument("length", type=int, nargs="?", default=32768, metavar="LENGTH",
                        help="prompt tokens (default 32768)")
    args = parser.parse_args()
    main(args.out, args.length)

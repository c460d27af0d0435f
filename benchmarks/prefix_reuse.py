"""Many questions over one long document: time to first token with and without the prefix cache.

One engine (random weights of the Llama-3-8B shape, as ``tokenselect bench e2e`` builds it; real prose as the
document), one document of ``--doc-tokens`` tokens and ``--questions`` different questions after it, each asked
with a few new tokens to generate. Four runs, in this order, on the same engine:

    without reuse, in turn    each question alone, after the previous one finished: every prompt prefilled whole
    without reuse, at once    all questions queued together (the pool admits as many as fit; the rest wait)
    with reuse, in turn       an empty prefix cache: the first question computes the document, the next reuse it
    with reuse, at once       an empty prefix cache again: the first computes the document while the others wait,
                              then each starts after it

Time to first token: from the request's submission (for "at once", the common submission) to its first new
token, on the host after the step that sampled it (which waited for the GPU). Before the runs, an untimed warm-up
request (prefix cache off) compiles the kernels.

    python benchmarks/prefix_reuse.py OUTDIR                          # Llama-3-8B shape, 131000-token document
    python benchmarks/prefix_reuse.py OUTDIR --config tiny --doc-tokens 2000 --device cpu     # a try on a CPU

writes OUTDIR/prefix_reuse.md and OUTDIR/prefix_reuse.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's tokenselect, installed or not
from tokenselect.bench.e2e import CONFIGS, parse_length, text_prompt, warm_up  # noqa: E402
from tokenselect.engine import LLM  # noqa: E402
from tokenselect.sampling import SamplingParams  # noqa: E402


def questions(n: int, length: int, vocab: int, doc_tokens: int) -> list[list[int]]:
    """``n`` different questions of ``length`` tokens: prose from past the document's end, a different part each."""
    prose = text_prompt(doc_tokens + n * (length + 97), vocab)[doc_tokens:]
    return [prose[i * (length + 97):i * (length + 97) + length] for i in range(n)]


def in_turn(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[dict]:
    rows = []
    for ids in prompts:
        start = time.perf_counter()
        seq = llm.add_request(ids, params)
        while not seq.finished:
            llm.step()
        rows.append({"ttft_s": seq.first_token_at - start, "cached_tokens": seq.cached_tokens})
    return rows


def at_once(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[dict]:
    start = time.perf_counter()
    seqs = [llm.add_request(ids, params) for ids in prompts]
    while llm.scheduler.has_work():
        llm.step()
    return [{"ttft_s": s.first_token_at - start, "cached_tokens": s.cached_tokens} for s in seqs]


def run(args: argparse.Namespace) -> dict:
    config = dict(CONFIGS[args.config])
    if args.layers:
        config["num_hidden_layers"] = args.layers
    settings = json.loads(args.settings) if args.settings else {}
    llm = LLM.random(config, args.attention, device=args.device, chunk_size=args.chunk_size,
                     kv_cache_tokens=args.kv_cache_tokens, kv_dtype=args.kv_dtype, **settings)
    doc = text_prompt(args.doc_tokens, config["vocab_size"])
    prompts = [doc + q for q in questions(args.questions, args.question_tokens, config["vocab_size"],
                                         args.doc_tokens)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    print(f"engine: {args.attention} on {llm.device}, {llm.cache.n_slots}-slot KV pool; document {len(doc)} tokens, "
          f"{len(prompts)} questions of {args.question_tokens}", flush=True)
    llm.set_prefix_cache(False)
    warm_up(llm, doc)
    runs = {}
    for reuse in (False, True):
        for name, how in (("in turn", in_turn), ("at once", at_once)):
            llm.set_prefix_cache(reuse)  # (re)starts an empty prefix cache
            label = f"{'with' if reuse else 'without'} reuse, {name}"
            t0 = time.perf_counter()
            runs[label] = how(llm, prompts, params)
            print(f"{label}: {time.perf_counter() - t0:.1f} s; TTFT "
                  + ", ".join(f"{r['ttft_s']:.3f}" for r in runs[label]), flush=True)
    device = torch.cuda.get_device_name(llm.device) if llm.device.type == "cuda" else "CPU"
    return {"device": device, "config": args.config, "layers": config["num_hidden_layers"],
            "attention": args.attention, "settings": settings, "doc_tokens": len(doc),
            "question_tokens": args.question_tokens, "chunk_size": llm.chunk_size, "kv_dtype": str(llm.kv_dtype),
            "max_tokens": args.max_tokens, "runs": runs}


def report(result: dict, command: str) -> str:
    runs = result["runs"]
    labels = list(runs)
    n = len(runs[labels[0]])
    lines = [f"# Many questions over one document: time to first token, {result['config']} "
             f"({result['layers']} layers, random weights), {result['attention']}, on {result['device']}", "",
             f"A {result['doc_tokens']}-token document, {n} different questions of {result['question_tokens']} tokens "
             f"after it, {result['max_tokens']} new tokens each; chunk {result['chunk_size']}, KV "
             f"{result['kv_dtype'].removeprefix('torch.')}. Seconds from submission to the first new token "
             "(\"at once\": from the common submission); in brackets the prompt tokens reused from the prefix cache.",
             "", "| question | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for i in range(n):
        cells = [f"{runs[label][i]['ttft_s']:.3f} ({runs[label][i]['cached_tokens']})" for label in labels]
        lines.append(f"| {i + 1} | " + " | ".join(cells) + " |")
    follow = [r["ttft_s"] for r in runs["with reuse, in turn"][1:]]
    fresh = [r["ttft_s"] for r in runs["without reuse, in turn"]]
    last_at_once = {label: max(r["ttft_s"] for r in runs[label]) for label in labels if "at once" in label}
    lines += ["", "## Summary", "",
              f"- follow-up question (2..{n}, in turn) with reuse: median {statistics.median(follow):.3f} s, "
              f"max {max(follow):.3f} s; the same question without reuse: median {statistics.median(fresh):.3f} s "
              f"({statistics.median(fresh) / statistics.median(follow):.1f}x)." if follow else "",
              "- all questions at once, the last first token: "
              + "; ".join(f"{label} {t:.2f} s" for label, t in last_at_once.items()) + ".",
              "", f"Command: `{command}`"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="folder for prefix_reuse.md and prefix_reuse.json")
    p.add_argument("--config", default="llama3-8b", choices=sorted(CONFIGS), help="model shape (default llama3-8b)")
    p.add_argument("--layers", type=int, help="override the number of layers (quick runs)")
    p.add_argument("--attention", default="tokenselect", help="policy (default tokenselect)")
    p.add_argument("--settings", help='policy settings as JSON, e.g. \'{"k": 4096}\'')
    p.add_argument("--doc-tokens", type=parse_length, default=131000,
                   help="document length (default 131000: 128K less 72, so that a follow-up computes the document's "
                        "last partial chunk again, 440 tokens of a 512-token chunk, 1976 of a 2048-token one, as it "
                        "would for a document of any length; 128k = 131072 would be a multiple of the chunk)")
    p.add_argument("--questions", type=int, default=10, help="questions asked (default 10)")
    p.add_argument("--question-tokens", type=int, default=64, help="tokens of each question (default 64)")
    p.add_argument("--max-tokens", type=int, default=8, help="new tokens per question (default 8)")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="prefill chunk (default: the engine's for the policy, 2048 for TokenSelect)")
    p.add_argument("--kv-cache-tokens", type=int, help="KV pool size (default: what fits)")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8", "bf16"])
    p.add_argument("--device", default=None)
    args = p.parse_args(argv)
    result = run(args)
    args.out.mkdir(parents=True, exist_ok=True)
    command = "python benchmarks/prefix_reuse.py " + " ".join(sys.argv[1:] if argv is None else argv)
    (args.out / "prefix_reuse.json").write_text(json.dumps(result, indent=1))
    text = report(result, command)
    (args.out / "prefix_reuse.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Speed of the transformers backend (``tokenselect.hf``) against our engine, on the same model and weights, on
one device: prefill seconds and decode ms/token at a few prompt lengths, for each policy, written as a markdown
table.

    python benchmarks/hf_backend_speed.py --model smollm2-135m-instruct \
        --out benchmarks/results/hf_backend_speed_h100.md

The engine loads the model (a registry name, a GGUF file or a Hugging Face folder; or ``--random`` for a
Llama-shaped model of random weights); the transformers model is built from the engine's own weight tensors
(shared, not copied: ``checkpoint_parts`` names each engine parameter's checkpoint tensors), so both run the same
numbers. Per policy: the engine (``tokenselect.bench.e2e.measure``: prefill in chunks, CUDA graphs on a GPU)
against ``model.generate`` with ``attn_implementation="tokenselect"`` and a ``tokenselect.hf.PolicyCache`` of the
same settings, prefilled in the engine's chunks (``prefill_chunk_size``); policy ``full`` runs transformers' own
SDPA attention (what users run today). Before the timed runs, each system serves one prompt two chunks past the
window (or the longest length) untimed, so Triton's compilation stays out of the timings; the greedy tokens of
that run (random token ids) are compared ("tokens agree": equal leading tokens of the first DECODE_CHECK).
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tokenselect import LLM, SamplingParams  # noqa: E402
from tokenselect.bench.e2e import measure, parse_length, sync  # noqa: E402
from tokenselect.bench.hf_dense import transformers_model  # noqa: E402
from tokenselect.policies import policy_spec  # noqa: E402

DECODE_CHECK = 8
# SmolLM2-135M's shape (random weights): what the real model measures, without its file
RANDOM = {
    "smollm2": {"architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
                "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                "num_key_value_heads": 3, "max_position_embeddings": 8192, "rope_theta": 100000.0,
                "rms_norm_eps": 1e-5, "tie_word_embeddings": True},
    "tiny": {"architectures": ["LlamaForCausalLM"], "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 256, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
             "tie_word_embeddings": False},
}


def hf_config(args) -> dict:
    """The model's Hugging Face config dict (of the GGUF metadata, the folder's config.json or ``--random``)."""
    if args.random:
        return dict(RANDOM[args.random])
    from tokenselect.models.gguf import GGUFCheckpoint, is_gguf
    from tokenselect.models.registry import resolve_model

    path = resolve_model(args.model)
    if is_gguf(path):
        return dict(GGUFCheckpoint(path).config)
    return json.loads((Path(path) / "config.json").read_text())


def prompt(n: int, vocab: int, kind: str) -> list[int]:
    if kind == "prose":
        from tokenselect.bench.e2e import text_prompt

        return text_prompt(n, vocab)
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def hf_generate(model, ids: list[int], policy: str, settings: dict, steps: int, chunk: int) -> dict:
    """``generate`` timed: prefill_s (to the first token's logits), decode_ms (per later token), tokens."""
    from transformers import LogitsProcessor, LogitsProcessorList

    import tokenselect.hf as tshf

    first: list[float] = []
    device = next(model.parameters()).device

    class FirstLogits(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if not first:
                sync(device)
                first.append(time.perf_counter())
            return scores

    model.set_attn_implementation("sdpa" if policy == "full" else "tokenselect")
    cache = None if policy == "full" else tshf.PolicyCache(policy, chunk=chunk, **settings)
    x = torch.tensor([ids], device=device)
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        out = model.generate(x, max_new_tokens=steps + 1, min_new_tokens=steps + 1, do_sample=False,
                             prefill_chunk_size=chunk, logits_processor=LogitsProcessorList([FirstLogits()]),
                             pad_token_id=0, **({} if cache is None else {"past_key_values": cache}))
    sync(device)
    end = time.perf_counter()
    hits, misses = cache.hits_misses() if cache is not None else (0, 0)
    return {"prefill_s": first[0] - start, "decode_ms": (end - first[0]) / steps * 1e3,
            "hit_rate": hits / (hits + misses) if hits + misses else None, "tokens": out[0, len(ids):].tolist()}


def fastest(runs: list[dict]) -> dict:
    """The first run's record with each time replaced by the fastest of ``runs``."""
    best = dict(runs[0])
    for key in ("prefill_s", "decode_ms"):
        best[key] = min(r[key] for r in runs)
    return best


def engine_tokens(llm, ids: list[int], n: int) -> list[int]:
    out = llm.generate([ids], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return list(out[0].token_ids)


def agree(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def table(rows: list[dict]) -> str:
    lines = ["| length | policy | engine prefill s | transformers prefill s | x | engine decode ms/token | "
             "transformers decode ms/token | x | hit rate (engine / transformers) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        e, h = r["engine"], r["transformers"]
        rate = " / ".join("-" if x is None else f"{x:.2f}" for x in (e["hit_rate"], h["hit_rate"]))
        lines.append(f"| {r['length']} | {r['label']} | {e['prefill_s']:.4f} | {h['prefill_s']:.4f} | "
                     f"{h['prefill_s'] / e['prefill_s']:.1f} | {e['decode_ms']:.2f} | {h['decode_ms']:.2f} | "
                     f"{h['decode_ms'] / e['decode_ms']:.1f} | {rate} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct", help="registry name, GGUF file or HF folder")
    p.add_argument("--random", choices=sorted(RANDOM), help="a Llama-shaped model of random weights instead")
    p.add_argument("--lengths", default="4k,16k,32k", help="comma list of prompt lengths (default 4k,16k,32k)")
    p.add_argument("--policies", default="full,tokenselect",
                   help="comma list of NAME[:key=value;...] (default full,tokenselect: the engine's defaults)")
    p.add_argument("--decode-steps", type=int, default=32, help="timed decode steps (default 32)")
    p.add_argument("--repeats", type=int, default=2,
                   help="runs of each length and policy; the table keeps each system's fastest (default 2: the "
                        "first run at a length pays one-time costs such as graph recording and allocator growth)")
    p.add_argument("--prompt", choices=("prose", "random"), default="prose",
                   help="prose: the corpus's text (real-text Selection Cache behaviour); random token ids")
    p.add_argument("--dtype", default="auto", help="the engine's dtype (default auto: the model's, fp32 on CPU)")
    p.add_argument("--out", type=Path, required=True, help="markdown file to write")
    args = p.parse_args(argv)

    lengths = [parse_length(x) for x in args.lengths.split(",")]
    config = hf_config(args)
    settings_of = dict(policy_spec(s) for s in args.policies.split(","))
    kv = max(lengths) + args.decode_steps + 64
    # no prefix cache: the prompts of one kind start alike, and a repeat is the same prompt; a reused prefix would
    # time the engine's reuse, not its prefill (transformers' generate starts each run from an empty cache)
    engine_settings = dict(dtype=args.dtype, kv_cache_tokens=kv, max_num_seqs=1, prefix_cache=False)
    t0 = time.perf_counter()
    if args.random:
        llm = LLM.random(config, "full", **engine_settings)
    else:
        llm = LLM(args.model, "full", **engine_settings)
    model = transformers_model(llm, config)
    window = int(config["max_position_embeddings"])
    chunk = llm.chunk_size
    vocab = int(config["vocab_size"])
    print(f"models ready in {time.perf_counter() - t0:.1f} s ({llm.device}, {llm.dtype}, chunk {chunk})", flush=True)

    rows, checks = [], []
    for spec, settings in settings_of.items():
        label = spec if not settings else f"{spec}:" + ";".join(f"{k}={v}" for k, v in settings.items())
        llm.set_attention(spec, **settings)
        # past the window (where TokenSelect's default dense_until ends) by two chunks, so that the selecting
        # kernels' variants compile here, not inside a timed run
        # random ids: prose repeats tokens, whose equal first-layer keys tie in a vote, and the backend's un-rotated
        # keys break such ties by rounding, not by index as the engine (docs/methods.md): the check would say little
        warm = prompt(min(max(lengths), window + 2 * chunk), vocab, "random")
        want = engine_tokens(llm, warm, DECODE_CHECK + 17)  # untimed: compiles the engine's kernels
        got = hf_generate(model, warm, spec, settings, DECODE_CHECK + 16, chunk)["tokens"]  # and the backend's
        checks.append(f"{label}: tokens agree on {agree(want[:DECODE_CHECK], got[:DECODE_CHECK])} of "
                      f"{DECODE_CHECK} at {len(warm)}")
        for n in lengths:
            ids = prompt(n, vocab, args.prompt)
            e = fastest([measure(llm, ids, args.decode_steps) for _ in range(args.repeats)])
            h = fastest([hf_generate(model, ids, spec, settings, args.decode_steps, chunk) for _ in range(args.repeats)])
            rows.append({"length": n, "label": label, "engine": e, "transformers": h})
            print(f"{n} {label}: engine {e['prefill_s']:.3f} s, {e['decode_ms']:.2f} ms/token; transformers "
                  f"{h['prefill_s']:.3f} s, {h['decode_ms']:.2f} ms/token", flush=True)
    device = torch.cuda.get_device_name() if llm.device.type == "cuda" else platform.processor() or "CPU"
    import transformers

    name = f"random {args.random}-shaped Llama" if args.random else args.model
    text = "\n".join([
        f"# transformers backend (tokenselect.hf) against the engine: {name}",
        "",
        f"Command: `python benchmarks/hf_backend_speed.py {shlex.join(argv if argv is not None else sys.argv[1:])}`",
        "",
        f"Device: {device}; dtype {llm.dtype}; transformers {transformers.__version__}, torch {torch.__version__}; "
        f"window {window}; prefill chunk {chunk} (both); {args.decode_steps} timed decode steps, fastest of "
        f"{args.repeats} runs; prompt {args.prompt}; total {time.perf_counter() - t0:.0f} s.",
        "",
        table(rows),
        "",
        f"Engine prompt tokens reused from its prefix cache: {llm.stats().get('prefix_cache_hit_tokens', 0)} (it is off: "
        "every run prefills its whole prompt, as generate does).",
        "",
        "x: transformers / engine. `full`: transformers' own SDPA attention against the engine's full attention "
        "policy. Other policies: the same engine policy object, asked through tokenselect.hf.",
        "",
        "Tokens (greedy, untimed warm-up run on random token ids): " + "; ".join(checks) + ". In fp16/bf16 the "
        "backend's un-rotated keys round differently from the engine's pre-RoPE keys, so near-ties in a vote may "
        "go the other way and the tokens part.",
        "",
    ])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

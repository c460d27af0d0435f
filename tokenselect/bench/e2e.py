"""``tokenselect bench e2e``: whole-model prefill and decode, every policy against dense, in one run.

The model is built from a config with random weights (speed does not depend on their values); the
prompt is real English text from the package's corpus, tokenized by the shipped tokenizer, so the
Selection Cache sees the query similarity of real token sequences. For each prompt length one
engine is built, then every policy runs on it in turn: prefill seconds, decode ms/token, Selection
Cache hit rate and peak GPU memory, with ratios against ``full`` measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "max_position_embeddings": 8192, "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}
TINY = {**LLAMA3_8B, "vocab_size": 8192, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024}
CONFIGS = {"llama3-8b": LLAMA3_8B, "tiny": TINY}


def parse_length(text: str) -> int:
    """'128k' -> 131072, '1m' -> 1048576, '5000' -> 5000."""
    text = text.strip().lower()
    scale = {"k": 1 << 10, "m": 1 << 20}.get(text[-1:], 1)
    return int(float(text.rstrip("km")) * scale)


def text_prompt(n: int, vocab: int) -> list[int]:
    """n token ids of real prose (repeated if the corpus is shorter)."""
    from ..data import default_model_path, prose_text
    from ..models import load_tokenizer

    ids = load_tokenizer(default_model_path())(prose_text()[:4_000_000])["input_ids"]
    ids = [i % vocab for i in ids]
    return (ids * (n // len(ids) + 1))[:n]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(llm, ids: list[int], decode_steps: int) -> dict:
    """Prefill the prompt, then decode ``decode_steps`` tokens, timing each phase."""
    from ..sampling import SamplingParams

    dev = llm.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    before = llm.policy.stats()
    seq = llm.add_request(ids, SamplingParams(max_tokens=decode_steps + 1, temperature=0, ignore_eos=True))
    sync(dev)
    start = time.perf_counter()
    while not seq.output_ids:
        llm.step()
    sync(dev)
    prefill = time.perf_counter() - start
    start = time.perf_counter()
    while not seq.finished:
        llm.step()
    sync(dev)
    decode = (time.perf_counter() - start) / decode_steps
    stats = llm.policy.stats()
    hits = stats.get("selection_cache_hits", 0) - before.get("selection_cache_hits", 0)
    misses = stats.get("selection_cache_misses", 0) - before.get("selection_cache_misses", 0)
    return {
        "prefill_s": prefill,
        "decode_ms": decode * 1e3,
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "peak_gb": torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else None,
    }


def run_length(config: dict, length: int, policies: list[str], args) -> list[dict]:
    from ..engine import LLM

    rows = []
    try:
        llm = LLM.random(config, "full", device=args.device, kv_cache_tokens=length + args.decode_steps + 8,
                         kv_dtype=args.kv_dtype, chunk_size=args.chunk_size, kernels=args.kernels)
    except torch.OutOfMemoryError:
        return [{"length": length, "policy": p, "error": "KV pool does not fit"} for p in policies]
    ids = text_prompt(length, config["vocab_size"])
    for policy in policies:
        llm.set_attention(policy)
        try:
            rows.append({"length": length, "policy": policy, **measure(llm, ids, args.decode_steps)})
        except torch.OutOfMemoryError:
            for seq in list(llm.scheduler.running) + list(llm.scheduler.waiting):
                llm.abort(seq)
            rows.append({"length": length, "policy": policy, "error": "out of memory"})
        print(json.dumps(rows[-1]), flush=True)
    del llm
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    """Markdown table with speedups against ``full`` at the same length."""
    dense = {r["length"]: r for r in rows if r["policy"] == "full" and "error" not in r}
    lines = ["| tokens | policy | prefill s | prefill x | decode ms/tok | decode x | SC hit rate | peak GB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        n = f"{r['length'] // 1024}K"
        if "error" in r:
            lines.append(f"| {n} | {r['policy']} | {r['error']} | | | | | |")
            continue
        d = dense.get(r["length"])
        px = f"{d['prefill_s'] / r['prefill_s']:.2f}x" if d else "dense n/a"
        dx = f"{d['decode_ms'] / r['decode_ms']:.2f}x" if d else "dense n/a"
        hit = f"{r['hit_rate']:.0%}" if r["hit_rate"] is not None else "-"
        peak = f"{r['peak_gb']:.1f}" if r["peak_gb"] is not None else "-"
        lines.append(f"| {n} | {r['policy']} | {r['prefill_s']:.2f} | {px} | {r['decode_ms']:.2f} | {dx} | {hit} | {peak} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        ok = [r for r in rows if r["policy"] == policy and "error" not in r]
        for ax, key in zip(axes, ("prefill_s", "decode_ms")):
            ax.plot([r["length"] for r in ok], [r[key] for r in ok], marker="o", label=policy)
    for ax, title in zip(axes, ("prefill (s)", "decode (ms/token)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    config = CONFIGS[args.config] if args.config in CONFIGS else json.loads(Path(args.config).read_text())
    if args.layers:
        config = {**config, "num_hidden_layers": args.layers}
    policies = args.policies.split(",")
    rows = []
    for length in [parse_length(x) for x in args.lengths.split(",")]:
        rows += run_length(config, length, policies, args)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    report = (f"# End-to-end: {args.config}, {config['num_hidden_layers']} layers, KV {args.kv_dtype}, "
              f"chunk {args.chunk_size}, {args.decode_steps} decode steps, on {device}\n\n{table(rows)}\n")
    print(report)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"e2e_{args.tag}" if args.tag else "e2e"
    (out / f"{stem}.json").write_text(json.dumps({"device": device, "config": args.config, "rows": rows}, indent=1))
    (out / f"{stem}.md").write_text(report)
    plot(rows, out / f"{stem}.png")
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "e2e", help="whole-model prefill/decode speed of every policy against dense",
        description="Time prefill (s) and decode (ms/token) of a random-weight model (default Llama-3-8B "
                    "shape) for each prompt length and policy, and write a table, JSON and plot.")
    p.add_argument("--config", default="llama3-8b", help="llama3-8b, tiny, or a config.json path")
    p.add_argument("--layers", type=int, help="override the number of layers (quick runs)")
    p.add_argument("--lengths", default="32k,128k", help="prompt lengths, e.g. 32k,128k,512k,1m")
    p.add_argument("--policies", default="full,streaming,infllm,tokenselect")
    p.add_argument("--decode-steps", type=int, default=32)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8", "bf16"])
    p.add_argument("--kernels", choices=["triton", "torch"])
    p.add_argument("--device", default=None)
    p.add_argument("--output", default="benchmarks/results")
    p.add_argument("--tag", default="", help="suffix for the output files")
    p.set_defaults(func=run)

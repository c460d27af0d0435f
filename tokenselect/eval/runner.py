"""Run tasks x lengths x samples x attention policies on one model and write what every sample got.

The model is loaded once per RoPE setting and the policies are switched on it with
``LLM.set_attention``. A policy written ``NAME@SCALING`` (e.g. ``full@dynamic:4``) runs on its own
engine with that RoPE scaling, so "full + dynamic NTK" sits in the same table as the others.

Outputs in ``--output``: ``predictions.jsonl`` and ``predictions.csv`` (one row per sample and
policy), ``summary.json`` (mean score x 100 per policy, task and length) and the plots.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import re
import sys
from pathlib import Path

from .metrics import score
from .tasks import TASKS, Sample, make_sample

# new tokens per task, as the benchmarks set them (InfiniteBench ``src/eval_utils.py``, RULER ``synthetic.yaml``)
MAX_TOKENS = {"passkey": 6, "number_string": 12, "kv_retrieval": 50, "vt": 30, "cwe": 120, "fwe": 50}
NIAH_MAX_TOKENS = 128


def parse_length(text: str, window: int) -> int:
    """``4k`` -> 4096, ``2x`` -> twice the model's window, ``5000`` -> 5000 tokens."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMxX]?)", text.strip())
    if not match:
        raise ValueError(f"bad length {text!r}: use tokens (5000), 4k / 1m, or window multiples (4x)")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * {"": 1, "k": 1024, "m": 1024 ** 2, "x": window}[unit])


def depths(n: int) -> list[float]:
    """``n`` needle depths spread evenly over [0, 1] (0.5 for a single sample)."""
    return [i / (n - 1) for i in range(n)] if n > 1 else [0.5]


def split_policy(spec: str) -> tuple[str, str | None]:
    """``full@dynamic:4`` -> ("full", "dynamic:4"); ``tokenselect`` -> ("tokenselect", None)."""
    name, _, rope = spec.partition("@")
    return name, rope or None


def format_prompt(tokenizer, sample) -> str:
    """The plain prompt for a base model; with a chat template, the prompt without its answer prefix
    as the user turn, and the answer prefix opening the assistant turn (as RULER does)."""
    if tokenizer.chat_template is None:
        return sample.input
    question = sample.input[: len(sample.input) - len(sample.answer_prefix)]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return chat + sample.answer_prefix.lstrip()


def max_tokens(task: str) -> int:
    return MAX_TOKENS.get(task, NIAH_MAX_TOKENS)


def make_samples(tasks: list[str], lengths: list[str], n_samples: int, llm, seed: int) -> list[dict]:
    """Every (task, length, sample) cell: its sample drawn from a seed of its own, so adding a task or
    a length leaves the others' samples unchanged. A length is the whole context, as in RULER: the
    prompt (special tokens and the chat template's own tokens included) plus the task's answer budget."""
    tokenizer = llm.tokenizer
    overhead = len(llm.encode(format_prompt(tokenizer, Sample("", [])))) - len(llm.encode(""))
    count = lambda text: len(llm.encode(text)) + overhead  # noqa: E731
    cells = []
    for task in tasks:
        for length in lengths:
            tokens = parse_length(length, llm.window)
            budget = tokens - max_tokens(task)
            if budget < 64:
                raise ValueError(f"length {length} ({tokens} tokens) leaves no room for a {task} prompt "
                                 f"next to its {max_tokens(task)}-token answer budget")
            for i, depth in enumerate(depths(n_samples)):
                sample = make_sample(task, budget, depth, random.Random(f"{seed}/{task}/{tokens}/{i}"), count)
                cells.append({"task": task, "length": length, "target_tokens": tokens, "sample": i,
                              "depth": depth, "prompt": format_prompt(tokenizer, sample),
                              "answers": sample.answers})
    return cells


def generate_all(llm, cells: list[dict], progress) -> list:
    """Greedy answers for every cell, all queued at once so the engine batches them (its scheduler
    admits as many as the KV pool holds). -> one RequestOutput per cell, in order."""
    from ..sampling import SamplingParams

    seqs = [llm.add_request(c["prompt"], SamplingParams(max_tokens=max_tokens(c["task"]), temperature=0))
            for c in cells]
    done = 0
    try:
        while done < len(seqs):
            llm.step()
            finished = sum(s.finished for s in seqs)
            progress.update(finished - done)
            done = finished
    except BaseException:
        for s in seqs:
            llm.abort(s)
        raise
    return [s.output() for s in seqs]


def evaluate(args: argparse.Namespace) -> tuple[list[dict], dict]:
    """Generate with every policy on every cell -> (one record per (cell, policy), the Selection Cache's
    counts over all the cells of each policy that has one: ``{policy: {"hits", "misses", "hit_rate"}}``, the
    hit rate of its decode steps on the eval's real text)."""
    from tqdm import tqdm

    from ..engine import LLM
    from ..policies import policy_kwargs

    specs = [s.strip() for s in args.attention.split(",") if s.strip()]
    tasks = [t.strip() for t in args.task.split(",") if t.strip()]
    lengths = [x.strip() for x in args.lengths.split(",") if x.strip()]
    by_rope: dict[str | None, list[str]] = {}
    for spec in specs:
        by_rope.setdefault(split_policy(spec)[1], []).append(spec)
    records, cells, selection_cache = [], None, {}
    progress = tqdm(total=len(specs) * len(tasks) * len(lengths) * args.samples, desc="eval", unit="sample",
                    file=sys.stderr)
    for rope, group in by_rope.items():
        first = split_policy(group[0])[0]
        settings = policy_kwargs(args, first)
        if rope:
            settings["rope_scaling"] = rope
        llm = LLM(args.model, first, **settings)
        if cells is None:
            cells = make_samples(tasks, lengths, args.samples, llm, args.seed)
        for spec in group:
            name = split_policy(spec)[0]
            llm.set_attention(name, **policy_kwargs(args, name, engine=False))
            progress.set_postfix_str(spec)
            for cell, out in zip(cells, generate_all(llm, cells, progress)):
                records.append({"policy": spec, "task": cell["task"], "length": cell["length"],
                                "target_tokens": cell["target_tokens"], "prompt_tokens": len(out.prompt_token_ids),
                                "sample": cell["sample"], "depth": cell["depth"], "answers": cell["answers"],
                                "prediction": out.text, "score": score(cell["task"], out.text, cell["answers"])})
            stats = llm.stats()  # the policy's own counters: set_attention started them afresh
            if "selection_cache_hits" in stats:
                selection_cache[spec] = {"hits": stats["selection_cache_hits"],
                                         "misses": stats["selection_cache_misses"],
                                         "hit_rate": round(stats["selection_cache_hit_rate"], 4)}
    progress.close()
    return records, selection_cache


def selection_cache_lines(selection_cache: dict) -> str:
    """The table's note of each policy's Selection Cache hit rate ('' without one)."""
    return "".join(f"\nSelection Cache of {policy}: {c['hit_rate']:.1%} hits ({c['hits']} of "
                   f"{c['hits'] + c['misses']} decode lookups, every layer of every step of every sample).\n"
                   for policy, c in selection_cache.items())


def summarize(records: list[dict]) -> dict:
    """Mean score x 100 as ``{policy: {task: {length: score}}}``, in the order first seen."""
    sums: dict = {}
    for r in records:
        cell = sums.setdefault(r["policy"], {}).setdefault(r["task"], {}).setdefault(r["length"], [0.0, 0])
        cell[0] += r["score"]
        cell[1] += 1
    return {p: {t: {n: round(100 * s / c, 2) for n, (s, c) in by_len.items()} for t, by_len in by_task.items()}
            for p, by_task in sums.items()}


def markdown_table(scores: dict) -> str:
    """Rows task x length, one column per policy."""
    policies = list(scores)
    rows = dict.fromkeys((t, n) for by_task in scores.values() for t, by_len in by_task.items() for n in by_len)
    lines = ["| task | length | " + " | ".join(policies) + " |", "|---|---|" + "---|" * len(policies)]
    for task, length in rows:
        cells = [scores[p].get(task, {}).get(length) for p in policies]
        lines.append(f"| {task} | {length} | " + " | ".join("" if c is None else f"{c:.1f}" for c in cells) + " |")
    return "\n".join(lines)


def title(args: argparse.Namespace, records: list[dict]) -> str:
    """One line naming what was run: model, samples per cell, device."""
    import torch

    model = Path(args.model).name if args.model else "default model"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "CPU"
    return (f"Eval: {model}, {args.samples} samples per cell (score x 100, greedy), seed {args.seed}, "
            f"on {device}")


def write_outputs(records: list[dict], scores: dict, config: dict, out: Path,
                  selection_cache: dict | None = None) -> None:
    """predictions.jsonl, predictions.csv and summary.json (with the Selection Cache's counts) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "predictions.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    with open(out / "predictions.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        for r in records:
            writer.writerow({**r, "answers": json.dumps(r["answers"])})
    summary = {"config": config, "scores": scores, "selection_cache": selection_cache or {}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def check_names(args: argparse.Namespace) -> None:
    """ValueError for an unknown task or policy, or fewer than one sample."""
    from ..policies import POLICIES

    unknown = [t for t in args.task.split(",") if t.strip() not in TASKS]
    unknown += [a for a in args.attention.split(",") if split_policy(a.strip())[0] not in POLICIES]
    if unknown:
        raise ValueError(f"unknown task or policy: {', '.join(unknown)}")
    if args.samples < 1:
        raise ValueError("--samples must be at least 1")


def run(args: argparse.Namespace) -> int:
    """``tokenselect eval``: check the names, evaluate, write the files and plots, print the table."""
    from .plots import plot_all

    check_names(args)
    records, selection_cache = evaluate(args)
    scores = summarize(records)
    config = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()
              if key != "func"}
    out = Path(args.output)
    write_outputs(records, scores, config, out, selection_cache)
    plot_all(records, out)
    table = markdown_table(scores)
    notes = selection_cache_lines(selection_cache)
    (out / "table.md").write_text(f"# {title(args, records)}\n\n{table}\n\nCommand: `tokenselect eval "
                                  f"{' '.join(sys.argv[2:]) if sys.argv[1:2] == ['eval'] else '...'}`\n{notes}")
    print(table + ("\n" + notes if notes else ""))
    print(f"wrote {out}/predictions.jsonl, predictions.csv, summary.json, table.md and plots", file=sys.stderr)
    return 0

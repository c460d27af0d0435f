"""What a needle task's wrong answers say: for each answer of an eval table's needle-in-a-haystack cells, whether it
names the asked needle's value (right), another needle's value, a needle's key, or none of the needles (text of the
haystack, or a value the prompt does not hold).

The prompts are those the eval made (its prompt cache, or built again from the tokenizer alone), so each answer is
read against the very text the model saw. RULER's needles read "One of the special magic {kind} for {key} is:
{value}." (``eval/tasks/niah.py``); every needle of a prompt is found by that sentence.

    python benchmarks/needle_answers.py PREDICTIONS --model qwen2.5-coder-0.5b-instruct --task niah_multikey_1 \\
        --lengths 8x [--policies tokenselect,reattention] [--out OUT.md]

PREDICTIONS: a ``predictions.jsonl`` (or ``.jsonl.gz``) of ``tokenselect eval`` or a merged table. The prompts'
settings (``--samples``, ``--seed``, ``--chat``) must be those the table ran with (its title states them).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re
import sys
from pathlib import Path

from tokenselect.data import default_model_path
from tokenselect.eval.runner import make_samples
from tokenselect.models.loader import Checkpoint
from tokenselect.models.registry import home, resolve_model

NEEDLE = re.compile(r"One of the special magic \w+ for (\S+) is: (\S+?)\.(?:\s|$)")
KINDS = ("right", "another needle's value", "a needle's key", "no needle's key or value")


def needles(text: str) -> dict[str, str]:
    """The prompt's needles, key -> value."""
    return {key: value for key, value in NEEDLE.findall(text)}


def kind(prediction: str, answers: list[str], planted: dict[str, str]) -> str:
    """Which of ``KINDS`` an answer is: the asked value first, then another needle's value, then a key."""
    if any(a in prediction for a in answers):
        return KINDS[0]
    if any(value in prediction for value in planted.values() if value not in answers):
        return KINDS[1]
    if any(key in prediction for key in planted):
        return KINDS[2]
    return KINDS[3]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("predictions", type=Path)
    p.add_argument("--model", default=None, help="a registry name, a GGUF file or a folder (default: the embedded model)")
    p.add_argument("--task", required=True, help="one needle task, e.g. niah_multikey_1")
    p.add_argument("--lengths", required=True, help="comma-separated, as the table names them: 4x,8x")
    p.add_argument("--policies", default=None, help="comma-separated columns (default: every one in the file)")
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat", choices=["on", "off"], default="off")
    p.add_argument("--prompt-cache", default=None, help="default $TOKENSELECT_HOME/eval-prompts")
    p.add_argument("--out", type=Path, default=None, help="also write the table here (markdown)")
    args = p.parse_args(argv)
    lengths = args.lengths.split(",")
    opener = gzip.open if args.predictions.suffix == ".gz" else open
    with opener(args.predictions, "rt") as f:
        rows = [r for r in map(json.loads, filter(str.strip, f)) if r["task"] == args.task and r["length"] in lengths]
    policies = args.policies.split(",") if args.policies else list(dict.fromkeys(r["policy"] for r in rows))
    rows = [r for r in rows if r["policy"] in policies]
    if not rows:
        raise SystemExit(f"no answers of {args.task} at {args.lengths} for {', '.join(policies)} in {args.predictions}")
    checkpoint = Checkpoint(resolve_model(args.model) if args.model else default_model_path())
    tokenizer = checkpoint.tokenizer()
    cache = Path(args.prompt_cache) if args.prompt_cache else home() / "eval-prompts"
    cells = make_samples(tokenizer, checkpoint.config.window, [args.task], lengths, args.samples, args.seed,
                         args.chat == "on", cache)
    planted = {(c["length"], c["sample"]): needles(tokenizer.decode(c["prompt"])) for c in cells}
    counts: dict[tuple[str, str], collections.Counter] = {}
    for r in rows:
        found = planted[(r["length"], r["sample"])]
        if not found:
            raise SystemExit(f"no needle found in the prompt of {args.task} {r['length']} sample {r['sample']}")
        counts.setdefault((r["policy"], r["length"]), collections.Counter())[kind(r["prediction"], r["answers"],
                                                                                  found)] += 1
    lines = [f"# What the answers of {args.task} name ({args.predictions.name})", "",
             "| policy | length | samples | " + " | ".join(KINDS) + " |", "|---|---|---|" + "---|" * len(KINDS)]
    for (policy, length), c in counts.items():
        lines.append(f"| {policy} | {length} | {sum(c.values())} | " + " | ".join(str(c[k]) for k in KINDS) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return {f"{policy} {length}": dict(c) for (policy, length), c in counts.items()}


if __name__ == "__main__":
    main(sys.argv[1:])

"""Selection recall of the needle: per layer and step, are the needle's tokens among those a policy attends?

Issue #27 item 4. RULER's niah_single_1 hides its needle in repeated filler ("The grass is green...") and
TokenSelect keeps it to 16x the window, while needles in ordinary prose fade. This tool runs one policy eagerly
(no CUDA graphs, so that every layer's selection can be read) over needles in several phrasings and depths,
and records, for the last prefill chunk (whose queries produce the first answer token) and for every decode
step, the fraction of the needle value's tokens among the attended slots, layer by layer.

    python benchmarks/needle_recall.py --model smollm2-135m-instruct --lengths 2x,4x --depths 5 \
        --styles ruler_noise,ruler_essay,prose,code --policy tokenselect --out OUT

Styles:
  ruler_noise  RULER niah_single_1: "One of the special magic numbers for {key} is: {value}." in filler lines
  ruler_essay  RULER niah_single_2: the same needle between sentences of essays
  prose        a needle of other words in the same essays: "The blue safe in the attic opens with the code
               {value}.", asked "Which code opens the blue safe?"
  code         Python source as the haystack (this package's own files), the needle a constant
               `BLUE_SAFE_CODE = {value}` with a comment, asked in a trailing comment

Writes OUT/needle_recall.json (every sample: answer, score, recall per layer of the last chunk and of the
decode steps) and OUT/needle_recall.md (means per style, length and depth; recall per layer per style).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tokenselect import LLM, SamplingParams  # noqa: E402
from tokenselect.eval.runner import depths as spread_depths  # noqa: E402
from tokenselect.eval.runner import parse_length  # noqa: E402
from tokenselect.eval.tasks import niah  # noqa: E402
from tokenselect.eval.tasks.base import Sample, fit_sample  # noqa: E402
from tokenselect.eval.tasks.haystack import prose_slice, prose_words, random_number, split_sentences  # noqa: E402

ANSWER_TOKENS = 16


def depth_plan(spec: str) -> list[tuple[int, float]]:
    """--depths as (index, depth) pairs, the index seeding the sample: "N" (N depths spread evenly over 0..1), "N:A-B"
    (the same N depths' indices A to B only: a later process finishes a run cut off at depth A with the very samples
    the whole run would have drawn), or a list of depths "0.3,0.6"."""
    if ":" in spec:
        n, span = spec.split(":")
        first, last = map(int, span.split("-"))
        every = spread_depths(int(n))
        if not 0 <= first <= last < len(every):
            raise ValueError(f"--depths {spec}: indices {first}-{last} are not among the {len(every)} depths")
        return [(i, every[i]) for i in range(first, last + 1)]
    if "." in spec or "," in spec:
        return list(enumerate(float(d) for d in spec.split(",")))
    return list(enumerate(spread_depths(int(spec))))


def prose_needle(n: int, depth: float, rng: random.Random, _tokens: int) -> Sample:
    """n words of essays with the needle, in words unlike RULER's, between sentences at ``depth``."""
    value = random_number(rng)
    start = rng.randrange(len(prose_words()))
    sentences = split_sentences(prose_slice(n, start))
    sentences.insert(int(depth * len(sentences)), f"The blue safe in the attic opens with the code {value}.")
    prefix = " The blue safe opens with the code"
    prompt = "Read the text below.\n\n" + " ".join(sentences) + "\n\nWhich code opens the blue safe?"
    return Sample(prompt + prefix, [value], prefix)


def source_lines() -> list[str]:
    """This package's own Python source, line by line: a haystack of real code."""
    lines = []
    for path in sorted((ROOT / "tokenselect").rglob("*.py")):
        lines += path.read_text().splitlines()
    return lines


def code_needle(n: int, depth: float, rng: random.Random, _tokens: int) -> Sample:
    """n lines of Python source with a constant holding the value at ``depth``."""
    value = random_number(rng)
    source = source_lines()
    start = rng.randrange(len(source))
    lines = [source[(start + i) % len(source)] for i in range(n)]
    lines.insert(int(depth * len(lines)), f"BLUE_SAFE_CODE = {value}  # the code that opens the blue safe")
    prefix = "\n# Answer: the blue safe opens with the code"
    prompt = "\n".join(lines) + "\n\n# Question: which code opens the blue safe, according to the source above?"
    return Sample(prompt + prefix, [value], prefix)


def ruler(task: str):
    cfg = niah.CONFIGS[task]
    return lambda n, depth, rng, _tokens: niah.build(cfg, n, depth, rng)


STYLES = {"ruler_noise": ruler("niah_single_1"), "ruler_essay": ruler("niah_single_2"), "prose": prose_needle,
          "code": code_needle}


def needle_positions(tokenizer, text: str, value: str) -> list[int]:
    """Token indices (in ``tokenizer(text)``) covering the first occurrence of ``value`` in text."""
    start = text.index(value)
    end = start + len(value)
    encoded = tokenizer(text, return_offsets_mapping=True)
    return [i for i, (a, b) in enumerate(encoded["offset_mapping"]) if a < end and b > start and b > a]


class Recorder:
    """Wraps a policy's ``attend`` (an instance attribute, this tool's own policy object only) and records, for
    the sequence being run, the share of the needle's tokens among the attended slots at every layer."""

    def __init__(self, policy, n_layers: int):
        self.policy, self.n_layers = policy, n_layers
        self.attend = policy.attend
        policy.attend = self
        self.reset([], 0)

    def reset(self, positions: list[int], prompt_len: int) -> None:
        self.positions, self.prompt_len = torch.tensor(positions), prompt_len
        self.last_chunk = [float("nan")] * self.n_layers
        self.decode: list[list[float]] = []

    def __call__(self, layer, step, q, own):
        attended = self.attend(layer, step, q, own)
        if not step.decode and int(step.length) + q.shape[0] != self.prompt_len:
            return attended  # an earlier prefill chunk: the needle may not be cached yet
        chosen = attended.slots if attended.n_valid is None else attended.slots[: int(attended.n_valid)]
        needle = step.table[self.positions.to(step.table.device)]
        recall = torch.isin(needle, chosen).float().mean().item()
        if step.decode:
            if layer == 0:
                self.decode.append([float("nan")] * self.n_layers)
            self.decode[-1][layer] = recall
        else:
            self.last_chunk[layer] = recall
        return attended


def mean(values) -> float:
    values = [v for v in values if v == v]
    return sum(values) / len(values) if values else float("nan")


def setting_value(text: str) -> int | float | str:
    """``--set`` values: an int, a float, or a word (``selector=hard_vote``)."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def run(args: argparse.Namespace, save=None) -> dict:
    """Every sample of every style and length; ``save(result)`` after each, so that a run cut off keeps what it
    measured."""
    settings = dict(kv.split("=", 1) for kv in args.set) if args.set else {}
    settings = {k: setting_value(v) for k, v in settings.items()}
    model = None if args.model == "embedded" else args.model
    llm = LLM(model, attention=args.policy, cuda_graphs=False, **settings)
    tokenizer = llm.tokenizer
    recorder = Recorder(llm.policy, llm.config.n_layers)
    count = lambda text: len(tokenizer(text)["input_ids"])  # noqa: E731
    rows = []
    for style in args.styles.split(","):
        for length in args.lengths.split(","):
            target = parse_length(length, llm.window)
            for i, depth in depth_plan(args.depths):
                sample = fit_sample(STYLES[style], target - ANSWER_TOKENS, depth, f"{args.seed}/{style}/{target}/{i}",
                                    count)
                ids = tokenizer(sample.input)["input_ids"]
                positions = needle_positions(tokenizer, sample.input, sample.answers[0])
                recorder.reset(positions, len(ids))
                out = llm.generate([ids], SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0))[0]
                rows.append({"style": style, "length": length, "tokens": len(ids), "depth": depth,
                             "needle_tokens": len(positions), "answer": sample.answers[0], "prediction": out.text,
                             "score": float(sample.answers[0] in out.text),
                             "last_chunk": recorder.last_chunk, "decode": recorder.decode})
                if save is not None:
                    save({"model": str(args.model), "policy": args.policy, "settings": llm.policy_config,
                          "rows": rows})
                print(f"{style} {length} depth {depth:.2f}: score {rows[-1]['score']:.0f}, last chunk recall "
                      f"{mean(recorder.last_chunk):.2f}, decode {mean(sum(recorder.decode, [])):.2f}", file=sys.stderr)
    return {"model": str(args.model), "policy": args.policy, "settings": llm.policy_config, "rows": rows}


def report(result: dict) -> str:
    rows = result["rows"]
    lines = [f"# Selection recall of the needle: {result['model']}, {result['policy']}", "",
             f"Settings: `{json.dumps(result['settings'])}`. Recall = share of the needle value's tokens among the "
             "attended slots, averaged over layers (last prefill chunk: the step that yields the first answer token; "
             "decode: every layer of every answer step).", "",
             "| style | length | samples | score | last-chunk recall | layers with the whole needle | decode recall |",
             "|---|---|---|---|---|---|---|"]
    for key in dict.fromkeys((r["style"], r["length"]) for r in rows):
        cell = [r for r in rows if (r["style"], r["length"]) == key]
        whole = mean([mean([float(v == 1.0) for v in r["last_chunk"] if v == v]) for r in cell])
        lines.append(f"| {key[0]} | {key[1]} | {len(cell)} | {100 * mean([r['score'] for r in cell]):.0f} | "
                     f"{mean([mean(r['last_chunk']) for r in cell]):.2f} | {whole:.2f} | "
                     f"{mean([mean(sum(r['decode'], [])) for r in cell]):.2f} |")
    lines += ["", "Last-chunk recall by needle depth (mean over lengths):", "",
              "| style | " + " | ".join(f"{d:.2f}" for d in dict.fromkeys(r["depth"] for r in rows)) + " |",
              "|---|" + "---|" * len(dict.fromkeys(r["depth"] for r in rows))]
    for style in dict.fromkeys(r["style"] for r in rows):
        by_depth = [mean([mean(r["last_chunk"]) for r in rows if r["style"] == style and r["depth"] == d])
                    for d in dict.fromkeys(r["depth"] for r in rows)]
        lines.append(f"| {style} | " + " | ".join(f"{v:.2f}" for v in by_depth) + " |")
    n_layers = len(rows[0]["last_chunk"])
    lines += ["", "Last-chunk recall by layer (mean over samples):", "",
              "| style | " + " | ".join(str(i) for i in range(n_layers)) + " |", "|---|" + "---|" * n_layers]
    for style in dict.fromkeys(r["style"] for r in rows):
        per_layer = [mean([r["last_chunk"][i] for r in rows if r["style"] == style]) for i in range(n_layers)]
        lines.append(f"| {style} | " + " | ".join(f"{v:.2f}" for v in per_layer) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="folder, .gguf or registry name; embedded: the small model shipped with tokenselect")
    parser.add_argument("--policy", default="tokenselect")
    parser.add_argument("--set", action="append", help="a policy setting KEY=VALUE (repeatable), e.g. k=1024")
    parser.add_argument("--lengths", default="2x,4x", help="context lengths, as multiples of the window or tokens")
    parser.add_argument("--depths", default="5", help="N needle depths spread evenly over 0..1; N:A-B, those N depths' "
                        "indices A to B only (the rest of a run that was cut off); or a list: 0.3,0.6")
    parser.add_argument("--styles", default=",".join(STYLES), help=f"comma-separated: {', '.join(STYLES)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", required=True, help="output folder")
    args = parser.parse_args(argv)
    unknown = set(args.styles.split(",")) - set(STYLES)
    if unknown:
        parser.error(f"unknown style(s) {sorted(unknown)}: choose from {', '.join(STYLES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save(result: dict) -> None:
        (out / "needle_recall.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "needle_recall.md").write_text(report(result))

    result = run(args, save)
    save(result)
    print(report(result))
    return result


if __name__ == "__main__":
    main()

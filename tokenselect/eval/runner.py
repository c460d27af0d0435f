"""Run tasks x lengths x samples x attention policies on one model and write what every sample got.

The model is loaded once per RoPE setting and the policies are switched on it with
``LLM.set_attention``. A policy written ``NAME@SCALING`` (e.g. ``full@dynamic:4``) runs on its own
engine with that RoPE scaling, so "full + dynamic NTK" sits in the same table as the others.

The outputs, and how a run stops and resumes: ``eval/cli.py``'s DESCRIPTION (``tokenselect eval --help``). A
stopped run's ``summary.json`` says how many samples of how many it finished (its config's ``interrupted``).
"""

from __future__ import annotations

import argparse
import csv
import functools
import hashlib
import json
import math
import multiprocessing
import os
import random
import re
import signal
import sys
import threading
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from tqdm import tqdm

from ..data import default_model_path, prose_text
from ..engine import LLM, auto_fp8_keys
from ..models.loader import Checkpoint, chat_token_ids
from ..models.registry import home, resolve_model
from ..policies import POLICIES, policy_kwargs, policy_settings, policy_spec
from ..sampling import SamplingParams
from .metrics import score
from .tasks import MAX_NEW_TOKENS, TASKS, Sample, make_sample

PROMPT_FORMAT = 2  # bump when a generator or the prompt format changes: cached prompts then go stale


def parse_length(text: str, window: int | None = None) -> int:
    """``4k`` -> 4096, ``1m`` -> 1048576, ``5000`` -> 5000 tokens; with a model's ``window``, ``2x`` -> twice it."""
    units = {"": 1, "k": 1024, "m": 1024 ** 2, **({"x": window} if window else {})}
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([a-z]?)", text.strip().lower())
    if not match or match.group(2) not in units:
        raise ValueError(f"bad length {text!r}: use tokens (5000), 4k / 1m"
                         + (", or window multiples (4x)" if window else ""))
    return int(float(match.group(1)) * units[match.group(2)])


def depths(n: int) -> list[float]:
    """``n`` needle depths spread evenly over [0, 1] (0.5 for a single sample)."""
    return [i / (n - 1) for i in range(n)] if n > 1 else [0.5]


def split_policy(spec: str) -> tuple[str, dict, str | None]:
    """``full@dynamic:4`` -> ("full", {}, "dynamic:4"); ``tokenselect:theta=0.8`` -> ("tokenselect",
    {"theta": 0.8}, None): a policy, its own settings (over the flags') and its RoPE scaling."""
    head, _, rope = spec.partition("@")
    name, settings = policy_spec(head)
    return name, settings, rope or None


def use_chat(tokenizer, chat: str, where) -> bool:
    """``--chat`` auto | on | off -> whether prompts go through the chat template (on without one: an error)."""
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if chat == "on" and not has_template:
        raise ValueError(f"--chat on: {where} has no chat template")
    return has_template if chat == "auto" else chat == "on"


def format_prompt(tokenizer, sample, chat: bool) -> list[int]:
    """The prompt's token ids: plain, or with ``chat`` the prompt without its answer prefix as the user's
    turn and the answer prefix opening the assistant's (as RULER does)."""
    if not chat:
        return tokenizer(sample.input)["input_ids"]
    prefix = tokenizer(sample.answer_prefix.lstrip(), add_special_tokens=False)["input_ids"]
    return chat_token_ids(tokenizer, [{"role": "user", "content": sample.question}]) + prefix


def build_cell(tokenizer, chat: bool, seed: int, cell: dict) -> dict:
    """``cell`` (task, length, target_tokens, sample, depth) with its prompt's token ids and answers. A length
    is the whole context, as in RULER: the prompt (special tokens and the chat template's own tokens
    included) plus the task's answer budget. The sample is drawn from a seed of its own, so adding a task or
    a length leaves the others' samples unchanged."""
    overhead = len(format_prompt(tokenizer, Sample("", []), chat)) - len(tokenizer("")["input_ids"])
    count = lambda text: len(tokenizer(text)["input_ids"]) + overhead  # noqa: E731
    task, tokens, i = cell["task"], cell["target_tokens"], cell["sample"]
    sample = make_sample(task, tokens - MAX_NEW_TOKENS[task], cell["depth"],
                         random.Random(f"{seed}/{task}/{tokens}/{i}"), count)
    return {**cell, "prompt": format_prompt(tokenizer, sample, chat), "answers": sample.answers}


def tokenizer_probe() -> str:
    """Text whose tokens stand for a tokenizer's behaviour in ``prompt_cache_key``: the start of each text of the
    prose the haystacks come from, and the kinds of strings the tasks plant (numbers, UUIDs, words, code)."""
    texts = prose_text().split("\f")
    planted = ("0123456789 3141592 0.5 -17 1e-3 a7d3c2e1-94b0-4f1e-8c3a-2b9d6e0f1a45 The special magic number is: "
               "VAR_ABC = 12345; def f(x):\n\treturn x  # ok\n\n  café naïve 東京 🙂 \u00a0 ... !?;:'\"()[]{}")
    return "\n".join(text[:4000] for text in texts) + planted


def prompt_cache_key(tokenizer, chat: bool, seed: int) -> str:
    """What a cached prompt depends on besides its cell: the tokenizer as it behaves (its vocabulary, its chat
    template, and its tokens for ``tokenizer_probe``), the chat switch, the seed and the generators' version. Not
    the tokenizer's file: the same tokenizer built by another version of ``tokenizers`` or ``transformers``
    serializes differently and still makes the same prompts, which a GPU machine then need not build again."""
    digest = hashlib.sha256(f"{PROMPT_FORMAT}|{seed}|{chat}|{tokenizer.chat_template}|".encode())
    digest.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    digest.update(json.dumps(tokenizer.encode(tokenizer_probe(), add_special_tokens=False)).encode())
    return digest.hexdigest()[:16]


def make_samples(tokenizer, window: int, tasks: list[str], lengths: list[str], n_samples: int, seed: int,
                 chat: bool, cache: Path | None = None, workers: int = 1) -> list[dict]:
    """Every (task, length, sample) cell with its prompt, built by ``workers`` processes, each prompt read from
    (and written to) ``cache`` when given, so that other policies, runs and processes reuse it."""
    cells = []
    for task in tasks:
        for length in lengths:
            tokens = parse_length(length, window)
            if tokens - MAX_NEW_TOKENS[task] < 64:
                raise ValueError(f"length {length} ({tokens} tokens) leaves no room for a {task} prompt "
                                 f"next to its {MAX_NEW_TOKENS[task]}-token answer budget")
            cells += [{"task": task, "length": length, "target_tokens": tokens, "sample": i, "depth": depth}
                      for i, depth in enumerate(depths(n_samples))]
    folder = None if cache is None else Path(cache) / prompt_cache_key(tokenizer, chat, seed)
    files = [None if folder is None else folder / f"{c['task']}-{c['target_tokens']}-{c['sample']}-of-{n_samples}.json"
             for c in cells]
    built = [json.loads(f.read_text()) if f is not None and f.is_file() else None for f in files]
    todo = [i for i, b in enumerate(built) if b is None]
    if todo:
        build = functools.partial(build_cell, tokenizer, chat, seed)
        with tqdm(total=len(todo), desc="building prompts", unit="prompt", file=sys.stderr) as bar:
            if workers > 1 and len(todo) > 1:
                # fork: the children need no CUDA (prompts are built before any model is loaded)
                context = multiprocessing.get_context("fork")
                with ProcessPoolExecutor(workers, mp_context=context) as pool:
                    futures = {pool.submit(build, cells[i]): i for i in todo}
                    for future in as_completed(futures):
                        built[futures[future]] = future.result()
                        bar.update()
            else:
                for i in todo:
                    built[i] = build(cells[i])
                    bar.update()
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True)
            for i in todo:
                # a name of this process's own: processes building the same prompt side by side never write
                # into one file; the replace leaves whole files only for those reading beside them
                tmp = files[i].with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(built[i]))
                tmp.replace(files[i])
    return built


def names(text: str) -> list[str]:
    """A comma-separated flag's items: ``"a, b,"`` -> ["a", "b"]."""
    return [item.strip() for item in text.split(",") if item.strip()]


def prompts(args: argparse.Namespace, tokenizer, window: int, where, workers: int) -> list[dict]:
    """Every cell of the run with its prompt (``make_samples``, cached under ``--prompt-cache``); ``args.chat``
    becomes "on" or "off", as the prompts were made (recorded in the results)."""
    args.chat = "on" if use_chat(tokenizer, args.chat, where) else "off"
    cache = None if args.prompt_cache == "none" else Path(args.prompt_cache or home() / "eval-prompts")
    return make_samples(tokenizer, window, names(args.task), names(args.lengths), args.samples, args.seed,
                        args.chat == "on", cache, workers)


def record(spec: str, cell: dict, text: str, prompt_tokens: int, prefill_s: float, decode_s: float) -> dict:
    """One sample's row of the results: its cell, the policy's answer and score, its timings."""
    return {"policy": spec, "task": cell["task"], "length": cell["length"], "target_tokens": cell["target_tokens"],
            "prompt_tokens": prompt_tokens, "sample": cell["sample"], "depth": cell["depth"],
            "answers": cell["answers"], "prediction": text, "score": score(cell["task"], text, cell["answers"]),
            "prefill_s": round(prefill_s, 4), "decode_s": round(decode_s, 4)}


def hit_counts(hits: int, misses: int) -> dict:
    """A policy's Selection Cache counts as the results record them (hit rate 0 before any decision)."""
    return {"hits": hits, "misses": misses, "hit_rate": round(hits / (hits + misses), 4) if hits + misses else 0.0}


class Interrupted(Exception):
    """The run was asked to stop (``stop`` set by SIGTERM or Ctrl-C); raised between two engine steps, so a
    tensor-parallel engine's ranks are never left inside a collective."""


@dataclass
class Results:
    """What a run has finished so far: a record per (cell, policy) in the order they finished, and each policy's
    Selection Cache counts (``hit_counts``); ``expected``: how many records the whole run makes (policies x cells,
    set once the prompts are built). ``stream``, when set, is a file (created with its folder at the first record,
    so that a run failing before any leaves nothing) that gets each record as a JSON line at once; ``settings``, the
    run's (``run_settings``), go beside it into ``run.json`` with the first record, for a later ``--resume``."""
    records: list = field(default_factory=list)
    selection_cache: dict = field(default_factory=dict)
    stream: Path | None = None
    keys: list = field(default_factory=list)
    expected: int = 0
    settings: dict | None = None

    def add(self, rec: dict, key: tuple) -> None:
        """``rec`` finished; ``key`` (policy index, cell index) places it in ``ordered``."""
        self.records.append(rec)
        self.keys.append(key)
        if self.stream is not None:
            first = len(self.records) == 1
            if first:
                self.stream.parent.mkdir(parents=True, exist_ok=True)
                if self.settings is not None:
                    (self.stream.parent / "run.json").write_text(json.dumps(self.settings, indent=2) + "\n")
            with open(self.stream, "w" if first else "a") as f:
                f.write(json.dumps(rec) + "\n")

    def ordered(self) -> list[dict]:
        """The records by policy, then cell (as the run lists them), whatever order the engine finished them in."""
        return [rec for _, rec in sorted(zip(self.keys, self.records), key=lambda pair: pair[0])]


def generate_all(llm, cells: list[dict], progress, on_done=None, stop: threading.Event | None = None) -> list:
    """Greedy answers for every cell, all queued at once so the engine batches them (its scheduler
    admits as many as the KV pool holds); ``on_done(i, output)`` as cell i finishes. ``Interrupted`` (the
    unfinished requests aborted) once ``stop`` is set. -> one RequestOutput per cell, in order."""
    seqs = [llm.add_request(c["prompt"], SamplingParams(max_tokens=MAX_NEW_TOKENS[c["task"]], temperature=0))
            for c in cells]
    reported = [False] * len(seqs)
    try:
        while not all(reported):
            if stop is not None and stop.is_set():
                raise Interrupted
            llm.step()
            for i, s in enumerate(seqs):
                if s.finished and not reported[i]:
                    reported[i] = True
                    progress.update(1)
                    if on_done is not None:
                        on_done(i, s.output())
    except BaseException:
        for s in seqs:
            if not s.finished:
                llm.abort(s)
        raise
    return [s.output() for s in seqs]


def evaluate(args: argparse.Namespace, results: Results | None = None, stop: threading.Event | None = None,
             earlier: list[dict] | None = None) -> tuple[list[dict], dict]:
    """Generate with every policy on every cell -> (one record per (cell, policy), the Selection Cache's
    counts over all the cells of each policy that has one: ``{policy: {"hits", "misses", "hit_rate"}}``, the
    hit rate of its decode steps on the eval's real text). Both gather in ``results`` as samples finish, so
    that they stand when ``stop`` ends the run early (``Interrupted``). ``earlier``: records of a run with the
    same settings (``--resume``); those that answer one of this run's cells are kept, not generated again (the
    Selection Cache counts are then those of the samples generated now)."""
    results = Results() if results is None else results
    if getattr(args, "backend", "engine") == "transformers":
        from .hf_backend import evaluate_transformers

        if earlier:
            raise ValueError("--resume works with the engine backend, not transformers")

        return evaluate_transformers(args, results, stop)
    specs = names(args.attention)
    # an engine per RoPE scaling, and per kind of selection keys an engine started with the policy holds
    engines: dict[tuple[str | None, bool], list[str]] = {}
    for spec in specs:
        name, _, rope = split_policy(spec)
        engines.setdefault((rope, auto_fp8_keys(args.select_dtype, name)), []).append(spec)
    # the prompts first, from the tokenizer alone: their worker processes fork before any model is on a GPU
    path = resolve_model(args.model) if args.model is not None else default_model_path()
    checkpoint = Checkpoint(path)
    cells = prompts(args, checkpoint.tokenizer(), checkpoint.config.window, path,
                    args.workers or min(16, os.cpu_count() or 1))
    if args.prompts_only:
        return results.records, results.selection_cache
    args.policy_settings = {}  # each policy's settings as it ran, defaults filled in (recorded in the results)
    results.expected = len(specs) * len(cells)
    progress = tqdm(total=results.expected, desc="eval", unit="sample", file=sys.stderr)
    todo = {spec: list(range(len(cells))) for spec in specs}  # the cells each policy has still to answer
    index = cell_index(cells)
    kept = [(rec, index(rec)) for rec in earlier or []]
    stray = [rec for rec, i in kept if rec["policy"] not in todo or i is None]
    if stray:  # kept apart, they would be dropped from the folder the run rewrites
        raise ValueError(f"--resume: {len(stray)} earlier answers are for cells this run does not have (e.g. "
                         f"{stray[0]['policy']} {stray[0]['task']} {stray[0]['length']} sample {stray[0]['sample']}); "
                         "resume with the earlier run's --task, --lengths, --samples and --attention, or more")
    for rec, i in kept:  # --resume: an earlier run's answers to this run's very prompts stand
        if i in todo[rec["policy"]]:
            todo[rec["policy"]].remove(i)
            results.add(rec, (specs.index(rec["policy"]), i))
            progress.update(1)
    for (rope, _), group in engines.items():
        if not any(todo[spec] for spec in group):
            continue  # every answer of this engine's policies is in already
        first, own, _ = split_policy(group[0])
        settings = {**policy_kwargs(args, first), **own}
        if rope:
            settings["rope_scaling"] = rope
        llm = LLM(checkpoint, first, **settings)  # the checkpoint the prompts were built with, not read again
        try:
            for spec in group:
                name, own, _ = split_policy(spec)
                llm.set_attention(name, **{**policy_kwargs(args, name, engine=False), **own})
                args.policy_settings[spec] = {key: getattr(llm.policy, key) for key in policy_settings(name)
                                              if isinstance(getattr(llm.policy, key, None), (int, float, str))}
                if llm.select_dtype != llm.kv_dtype:  # the keys it scored: an fp8 copy (--select-dtype)
                    args.policy_settings[spec]["selection_keys"] = "fp8"
                fitted = llm.policy_config["fitted_to_window"]
                if fitted:  # defaults shrunk for a small window: say so where the results are read
                    args.policy_settings[spec]["fitted_to_window"] = f"{'/'.join(fitted)} (window {llm.window})"
                progress.set_postfix_str(spec)

                def done(j, out, spec=spec):  # j: the place among the cells this policy has to answer
                    i = todo[spec][j]
                    results.add(record(spec, cells[i], out.text, len(out.prompt_token_ids), out.prefill_s,
                                       out.decode_s), (specs.index(spec), i))

                try:
                    generate_all(llm, [cells[i] for i in todo[spec]], progress, done, stop)
                finally:  # the policy's own counters (set_attention started them afresh), an interrupted run's too
                    stats = llm.stats()
                    if "selection_cache_hits" in stats:
                        results.selection_cache[spec] = hit_counts(stats["selection_cache_hits"],
                                                                   stats["selection_cache_misses"])
        finally:
            llm.close()  # a tensor-parallel engine's ranks, before the next group's engine starts or the run ends
    progress.close()
    return results.ordered(), results.selection_cache


CELL_KEYS = ("task", "length", "sample", "target_tokens", "depth", "answers")  # what a record tells of its prompt


def cell_index(cells: list[dict]) -> Callable[[dict], int | None]:
    """A lookup: the index of the cell that a record answered, or None: the same task, length and sample, and the
    same prompt as far as a record tells it (its token target, needle depth and answers)."""
    def key(d: dict) -> tuple:  # lists (the answers) as tuples, to hash; numbers compare as ==, 0 as 0.0
        return tuple(tuple(v) if isinstance(v, list) else v for v in (d.get(k) for k in CELL_KEYS))

    where = {key(c): i for i, c in reversed(list(enumerate(cells)))}  # the first of equal cells, as a scan finds
    return lambda rec: where.get(key(rec))


# the flags that do not change what a sample answers: the cells a run covers may differ from an earlier run's
NOT_SETTINGS = ("output", "resume", "workers", "prompt_cache", "prompts_only", "func", "task", "lengths", "attention")


def run_settings(args: argparse.Namespace) -> dict:
    """The flags a run's answers depend on, as given (``run.json``): a resumed run must match them."""
    return {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()
            if key not in NOT_SETTINGS}


def resumed_records(args: argparse.Namespace, out: Path) -> list[dict]:
    """``--resume``: the records of ``out``'s earlier run, after checking that it ran with this run's settings
    (``run.json``). ValueError naming the flags that differ, or where no settings were kept."""
    saved, stream = out / "run.json", out / "predictions.jsonl"
    if not saved.is_file():
        if not stream.is_file():
            return []  # nothing to go on from: a first run
        raise ValueError(f"--resume: {out} holds answers but no run.json, so their settings are unknown; "
                         "run without --resume into another folder")
    before, now = json.loads(saved.read_text()), run_settings(args)
    changed = sorted(key for key in set(before) | set(now) if before.get(key) != now.get(key))
    if changed:
        raise ValueError("--resume: the earlier run in " + str(out) + " had other settings: " + "; ".join(
            f"{key} {before.get(key)!r} then, {now.get(key)!r} now" for key in changed))
    return [json.loads(line) for line in stream.read_text().splitlines() if line.strip()] if stream.is_file() else []


def selection_cache_lines(selection_cache: dict) -> str:
    """The table's note of each policy's Selection Cache hit rate ('' without one)."""
    return "".join(f"\nSelection Cache of {policy}: {c['hit_rate']:.1%} hits ({c['hits']} of "
                   f"{c['hits'] + c['misses']} decode lookups, every layer of every step of every sample).\n"
                   for policy, c in selection_cache.items())


def per_cell(records: list[dict], stat: Callable[[list[float]], object]) -> dict:
    """``stat`` of each cell's scores, ``{policy: {task: {length: stat(scores)}}}``, in the order first seen."""
    cells: dict = {}
    for r in records:
        cells.setdefault(r["policy"], {}).setdefault(r["task"], {}).setdefault(r["length"], []).append(r["score"])
    return {p: {t: {n: stat(v) for n, v in by_len.items()} for t, by_len in by_task.items()}
            for p, by_task in cells.items()}


def summarize(records: list[dict]) -> dict:
    """Mean score x 100 as ``{policy: {task: {length: score}}}``, in the order first seen."""
    return per_cell(records, lambda v: round(100 * sum(v) / len(v), 2))


def wilson(mean: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion ``mean`` (0..1) seen in ``n`` samples -> (low, high)
    in 0..1. Scores between 0 and 1 (a partial niah answer) are treated as the proportion they average to."""
    centre = (mean + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(mean * (1 - mean) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def intervals(records: list[dict]) -> dict:
    """The 95% interval (x 100) of each cell's mean score, ``{policy: {task: {length: [low, high]}}}``."""
    return per_cell(records, lambda v: [round(100 * x, 1) for x in wilson(sum(v) / len(v), len(v))])


def timings(records: list[dict]) -> dict:
    """Mean prefill seconds and decode seconds per sample, ``{policy: {length: {"prefill_s", "decode_s"}}}``."""
    cells: dict = {}
    for r in records:
        cells.setdefault(r["policy"], {}).setdefault(r["length"], []).append(r)
    return {p: {n: {key: round(sum(r[key] for r in v) / len(v), 3) for key in ("prefill_s", "decode_s")}
                for n, v in by_len.items()} for p, by_len in cells.items()}


def length_value(length: str) -> float:
    """The sort key of a length label: '2x' -> 2.0, '16384' -> 16384.0 (rows of one task in increasing length)."""
    try:
        return float(length.rstrip("x"))
    except ValueError:
        return float("inf")


def markdown_table(scores: dict, bounds: dict | None = None) -> str:
    """Rows task x length, one column per policy; with ``bounds`` (``intervals``) each score carries its 95%
    interval."""
    policies = list(scores)
    seen = dict.fromkeys((t, n) for by_task in scores.values() for t, by_len in by_task.items() for n in by_len)
    tasks = list(dict.fromkeys(t for t, _ in seen))
    rows = sorted(seen, key=lambda cell: (tasks.index(cell[0]), length_value(cell[1])))
    lines = ["| task | length | " + " | ".join(policies) + " |", "|---|---|" + "---|" * len(policies)]
    for task, length in rows:
        cells = []
        for p in policies:
            value = scores[p].get(task, {}).get(length)
            span = (bounds or {}).get(p, {}).get(task, {}).get(length)
            cells.append("—" if value is None else f"{value:.1f}" if span is None
                         else f"{value:.1f} ({span[0]:.0f}-{span[1]:.0f})")
        lines.append(f"| {task} | {length} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def title(args: argparse.Namespace) -> str:
    """One line naming what was run: model, samples per cell, device."""
    model = Path(args.model).name if args.model else "default model"
    if getattr(args, "backend", "engine") == "transformers":
        model += " (transformers, tokenselect.hf)"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "CPU"
    interval = ", 95% interval in brackets" if args.samples > 1 else ""
    return (f"Eval: {model}, chat template {args.chat}, {args.samples} samples per cell (score x 100, greedy"
            f"{interval}), seed {args.seed}, on {device}")


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
    summary = {"config": config, "scores": scores, "intervals": intervals(records), "timings": timings(records),
               "selection_cache": selection_cache or {}}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def check_names(args: argparse.Namespace) -> None:
    """ValueError for an unknown task or policy, or fewer than one sample."""
    # the lists as ``evaluate`` reads them (``names``: a trailing comma or spaces are no item)
    unknown = [t for t in names(args.task) if t not in TASKS]
    unknown += [a for a in names(args.attention) if split_policy(a)[0] not in POLICIES]
    for spec in names(args.attention):
        name, own, _ = split_policy(spec)
        bad = sorted(set(own) - set(policy_settings(name))) if name in POLICIES else []
        if bad:
            raise ValueError(f"{spec}: {name} takes no setting {', '.join(bad)}")
    if unknown:
        raise ValueError(f"unknown task or policy: {', '.join(unknown)}")
    if args.samples < 1:
        raise ValueError("--samples must be at least 1")


def stop_on_signals(stop: threading.Event):
    """The first SIGTERM or Ctrl-C sets ``stop`` (the run ends at the next engine step and writes what it has); a
    second one interrupts at once (``KeyboardInterrupt``), e.g. while prompts are still being built. The processes
    that build prompts (forked, so they inherit the handler) leave the signal to this one. -> a function that puts
    the former handlers back. Nothing is changed off the main thread, where Python takes no handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    owner = os.getpid()

    def ask(signum, frame):
        if os.getpid() != owner:
            return
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        print(f"\n{signal.Signals(signum).name}: stopping after this step; the finished samples are kept "
              "(again to stop at once)", file=sys.stderr)

    former = {sig: signal.signal(sig, ask) for sig in (signal.SIGTERM, signal.SIGINT)}

    def restore():
        for sig, handler in former.items():
            signal.signal(sig, handler)

    return restore


def run(args: argparse.Namespace) -> int:
    """``tokenselect eval``: check the names, evaluate, write the files and plots, print the table. Stopped by
    SIGTERM or Ctrl-C, it writes them from the samples finished and returns 130."""
    from .plots import plot_all

    check_names(args)
    out = Path(args.output)
    stop = threading.Event()
    restore = stop_on_signals(stop)
    interrupted = None
    try:
        if args.prompts_only:
            evaluate(args)
            print(f"built the prompts ({args.samples} per task and length, chat template {args.chat})",
                  file=sys.stderr)
            return 0
        earlier = resumed_records(args, out) if args.resume else []
        # a line per finished sample, as they finish; the settings beside them
        results = Results(stream=out / "predictions.jsonl", settings=run_settings(args))
        try:
            records, selection_cache = evaluate(args, results, stop, earlier)
        except Interrupted:
            records, selection_cache = results.ordered(), results.selection_cache
            interrupted = {"finished": len(records), "of": results.expected}
            print(f"stopped: {len(records)} of {results.expected} samples finished", file=sys.stderr)
    finally:
        restore()
    if not records:
        return 130
    scores = summarize(records)
    config = {key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items()
              if key != "func"}
    if interrupted:
        config["interrupted"] = interrupted
    write_outputs(records, scores, config, out, selection_cache)
    plot_all(records, out)
    table = markdown_table(scores, intervals(records) if args.samples > 1 else None)
    notes = selection_cache_lines(selection_cache) + "".join(
        f"\nSettings of {spec}: " + ", ".join(f"{k}={v}" for k, v in s.items()) + "\n"
        for spec, s in args.policy_settings.items() if s)
    stopped = (f" (stopped early: {interrupted['finished']} of {interrupted['of']} samples; a cell may hold fewer)"
               if interrupted else "")
    (out / "table.md").write_text(f"# {title(args)}{stopped}\n\n{table}\n\nCommand: `tokenselect eval "
                                  f"{' '.join(sys.argv[2:]) if sys.argv[1:2] == ['eval'] else '...'}`\n{notes}")
    print(table + ("\n" + notes if notes else ""))
    print(f"wrote {out}/predictions.jsonl, predictions.csv, summary.json, table.md and plots", file=sys.stderr)
    return 130 if interrupted else 0

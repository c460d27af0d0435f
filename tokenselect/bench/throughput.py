"""``tokenselect bench throughput``: serving throughput where attention, not the weights, sets the step time.

B requests of one long prompt each (default 32K tokens, every request a different stretch of the package's
prose) are decoded together, one token each a step; the table gives ms per step and decode tokens/s (B x steps /
seconds) for each batch size and method, with the ratio against the fastest dense row (``dense`` or the engine's
``full``) measured in the same run at the same batch size.

Prefilling B long prompts for every batch size would cost most of a device call, so each method prefills the
largest batch it is asked for once, times its decode, then drops sequences (the engine aborts them, the dense
baseline decodes fewer of its sequences) and times each smaller batch size, largest first. The first two steps
at a batch size are untimed: they record that size's CUDA graph and fill the engine's pipeline (its next step
queued before the previous one is read, ``overlap_decode``), so that a timed step is one pass. Before anything is
timed each method runs an untimed warm-up (kernel compiles), as ``bench e2e`` does.

How many requests fit: every method gets the KV budget the engine's pool gets by default (``LLM``'s
``_default_pool_tokens``: a share of the GPU memory free after the weights; ``--kv-cache-tokens`` sets it). A
method whose engine keeps a copy of the keys for selection (TokenSelect's fp8 copy, ``--select-dtype``) gets the
same bytes, so fewer tokens (4/5 with bf16 K and V). The engine admits as many requests as its pool holds (prompt +
every token they may generate); the dense baseline (``bench/dense.py``: one contiguous bf16 cache of that many
tokens per request, decoded in one flash attention call) holds as many caches as fit in the same bytes. Batch sizes
past that are rows that say so, and the largest batch that fits is measured too.

The engine's prompts are prefilled one request at a time, each sequence held out of the running list until the
last is in (``prefill_held``), so that none decodes while another prefills (a server would interleave them; here
every sequence starts decoding at the prompt's length, as dense's do).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Iterator

import torch

from ..config import ModelConfig
from ..engine import LLM, kv_label, pool_dtype, selection_keys_dtype, token_bytes
from ..eval.runner import parse_length
from ..models.loader import resolve_device, resolve_dtype
from ..policies import POLICIES, policy_spec
from ..sampling import SamplingParams
from ..sequence import Sequence
from . import e2e
from .dense import DenseRunner
from .floors import timed

DEFAULT_POLICIES = "dense,full,tokenselect,tokenselect:theta=-1"
UNTIMED_STEPS = 2  # at each batch size, before the timed steps


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids of real prose, each the next stretch of the corpus (so they differ)."""
    text = e2e.text_prompt(n * length, vocab)
    return [text[i * length:(i + 1) * length] for i in range(n)]


def new_tokens(batches: list[int], steps: int) -> int:
    """Tokens a request may generate: its first (the prefill's) and, at every batch size it may live through,
    UNTIMED_STEPS untimed and ``steps`` timed steps."""
    return 1 + (len(batches) + 1) * (steps + UNTIMED_STEPS)  # (the largest that fits may be a batch size of its own)


def measured_sizes(batches: list[int], fit: int) -> list[int]:
    """The batch sizes that fit, largest first, with the largest that fits when some asked for do not."""
    sizes = {b for b in batches if b <= fit} | ({fit} if 0 < fit < max(batches) else set())
    return sorted(sizes, reverse=True)


class DenseBatch:
    """The dense baseline behind the timing loop: a ``DenseRunner`` of ``n`` sequences, the first ``live`` of which
    a step decodes; its greedy tokens stay on the device (``outputs`` reads them)."""

    def __init__(self, runner: DenseRunner, chunk_size: int):
        self.runner, self.chunk_size = runner, chunk_size
        self.live = 0
        self._steps: list[torch.Tensor] = []  # each step's tokens [live]
        self._first: list[int] = []

    def prefill(self, prompts: list[list[int]]) -> None:
        for seq, ids in enumerate(prompts):
            self._first.append(int(self.runner.prefill(ids, self.chunk_size, seq).argmax()))
        self.live = len(prompts)
        self._next = torch.tensor(self._first, device=self.runner.device)

    def shrink(self, n: int) -> None:
        self.live = n

    def step(self) -> int:
        """One decode step of the live sequences -> tokens generated."""
        self._next = self.runner.decode(self._next[:self.live]).argmax(-1)
        self._steps.append(self._next)
        return self.live

    def outputs(self) -> list[list[int]]:
        """Each sequence's greedy tokens so far."""
        out = [[t] for t in self._first]
        for tokens in self._steps:
            for seq, token in enumerate(tokens.tolist()):
                out[seq].append(token)
        return out


class EngineBatch:
    """The engine behind the timing loop: its running sequences, aborted from the last to shrink the batch."""

    def __init__(self, llm: LLM, max_tokens: int):
        self.llm, self.max_tokens = llm, max_tokens
        self.seqs: list[Sequence] = []
        self.live = 0

    def prefill(self, prompts: list[list[int]]) -> None:
        params = SamplingParams(max_tokens=self.max_tokens, temperature=0, ignore_eos=True)
        self.seqs = prefill_held(self.llm, prompts, params)
        self.live = len(self.seqs)

    def shrink(self, n: int) -> None:
        for seq in self.seqs[n:self.live]:
            self.llm.abort(seq)
        self.live = n

    def step(self) -> int:
        """One engine step -> tokens generated."""
        return len(self.llm.step())

    def outputs(self) -> list[list[int]]:
        return [list(seq.output_ids) for seq in self.seqs]

    def close(self) -> None:
        for seq in self.seqs:
            if not seq.finished:
                self.llm.abort(seq)


def prefill_held(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[Sequence]:
    """Prefill each prompt alone (every step a chunk of it, as the engine prefills one long prompt), holding each
    sequence out of the scheduler's running list from its first token until the last prompt has its own, so that
    no sequence decodes while another prefills. The caller has checked that all of them fit the pool."""
    held = []
    try:
        for ids in prompts:
            seq = llm.add_request(ids, params)
            while not seq.output_ids and not seq.finished:
                llm.step()
            if seq.error is not None:
                raise RuntimeError(f"the prefill of request {len(held)} failed") from seq.error
            llm.scheduler.running.remove(seq)
            held.append(seq)
    finally:
        llm.scheduler.running.extend(held)
    return held


def time_batches(method, batches: list[int], steps: int, device: torch.device, label: str,
                 graph_steps=None) -> Iterator[dict]:
    """Decode at each batch size of ``batches`` (largest first; the method holds the largest): UNTIMED_STEPS
    untimed steps (they record the size's CUDA graph, and leave the engine's next step queued, as every timed step
    does: ``overlap_decode``), then ``steps`` timed ones -> a row for each. ``graph_steps()``: steps run as one
    graph so far (None: not counted)."""
    for batch in batches:
        method.shrink(batch)
        for _ in range(UNTIMED_STEPS):
            method.step()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        graphs = graph_steps() if graph_steps else None
        tokens, seconds = timed(device, lambda: sum(method.step() for _ in range(steps)))
        row = {"batch": batch, "ms_step": seconds / steps * 1e3, "tokens_s": tokens / seconds, "tokens": tokens,
               "steps": steps, "whole_graph_steps": graph_steps() - graphs if graph_steps else None,
               "peak_gb": torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else None}
        if tokens != batch * steps:
            row["error"] = f"{tokens} tokens in {steps} steps of {batch} sequences"
        print(f"  {label}: batch {batch}: {row['ms_step']:.2f} ms/step, {row['tokens_s']:.1f} tokens/s", flush=True)
        yield row


def not_fitting(base: dict, batches: list[int], fit: int, per_request: int, budget: int) -> list[dict]:
    """A method's rows (``base``: its policy, KV and fit) of the batch sizes past the ``fit`` requests it holds."""
    why = f"does not fit: a {budget}-token KV budget holds {fit} requests of {per_request} tokens"
    return [{**base, "batch": b, "fit": False, "error": why} for b in batches if b > fit]


def run_dense(config: dict, batches: list[int], args) -> Iterator[dict]:
    """The dense baseline's rows: those of the batch sizes that do not fit, then one per measured batch size."""
    llm = LLM.random(config, "full", device=args.device, kv_cache_tokens=16, chunk_size=args.chunk_size,
                     kernels=args.kernels, cuda_graphs=args.cuda_graphs,
                     weight_dtype=args.weight_dtype)  # its own pool unused: DenseRunner's cache
    per_request = args.length + new_tokens(batches, args.decode_steps)
    budget = args.kv_cache_tokens or llm._default_pool_tokens("none")  # the engine's rule, KV of the model's dtype
    fit = budget // per_request
    n, runner = min(fit, max(batches)), None
    while n > 0 and runner is None:
        try:
            runner = DenseRunner(llm, per_request, n)
        except torch.OutOfMemoryError:  # the budget did not hold after all: one request fewer
            e2e.free_memory()
            n, fit = n - 1, n - 1
    base = {"policy": "dense", "kv": kv_label(llm.dtype, "none"), "fit_batch": fit}
    yield from not_fitting(base, batches, fit, per_request, budget)
    if runner is None:
        return
    print(f"dense: {n} requests of {per_request} tokens ({fit} fit a {budget}-token budget), prefilling", flush=True)
    warm = prompts(1, min(args.length, e2e.WARMUP_TOKENS), config["vocab_size"])[0]
    runner.prefill(warm, args.chunk_size)  # untimed: kernel compiles, the prefill chunk's graphs, a decode step
    runner.decode(torch.zeros(1, dtype=torch.int64, device=llm.device))
    runner.reset()
    method = DenseBatch(runner, args.chunk_size)
    base.update(held=n, prefill_s=timed_prefill(method, prompts(n, args.length, config["vocab_size"]), llm.device,
                                                "dense"))
    for row in time_batches(method, measured_sizes(batches, n), args.decode_steps, llm.device, "dense"):
        # with flash decode every step is one graph (``DenseRunner.decode``)
        yield {**base, **row, "whole_graph_steps": row["steps"] if runner.flash_decode else None}
    del method, runner, llm
    e2e.free_memory()


def timed_prefill(method, batch: list[list[int]], device: torch.device, label: str) -> float:
    """Seconds ``method`` takes to prefill every prompt of ``batch``."""
    _, seconds = timed(device, lambda: method.prefill(batch))
    print(f"{label}: prefilled {len(batch)} x {len(batch[0])} tokens in {seconds:.1f} s", flush=True)
    return seconds


def run_policy(llm: LLM, config: dict, policy: str, batches: list[int], args) -> Iterator[dict]:
    """One policy's rows on the engine: its fit, then a row per measured batch size."""
    name, settings = policy_spec(policy)
    llm.set_attention(name, **settings)
    max_tokens = new_tokens(batches, args.decode_steps)
    budget = llm.cache.n_slots  # tokens: the selection keys' copy paid already (``pool_tokens``)
    per_request = args.length + max_tokens
    fit = budget // per_request
    base = {"policy": policy, "kv": kv_label(llm.kv_dtype, "none", llm.select_dtype),
            "settings": llm.policy_config, "fit_batch": fit}
    yield from not_fitting(base, batches, fit, per_request, budget)
    n = min(fit, max(batches))
    if n == 0:
        return
    print(f"{policy}: {n} requests of {per_request} tokens ({fit} fit the {budget}-slot pool), prefilling", flush=True)
    method = EngineBatch(llm, max_tokens)
    sizes = measured_sizes(batches, n)
    try:
        e2e.warm_up(llm, prompts(1, args.length, config["vocab_size"])[0])
        base.update(held=n, prefill_s=timed_prefill(method, prompts(n, args.length, config["vocab_size"]), llm.device,
                                                    policy))
        graph_steps = (lambda: e2e.whole_steps(llm)) if llm.runner.graphs is not None else None
        for row in time_batches(method, sizes, args.decode_steps, llm.device, policy, graph_steps):
            sizes = sizes[1:]
            yield {**base, **row}
    except torch.OutOfMemoryError:
        for batch in sizes:
            yield {**base, "batch": batch, "error": "out of memory"}
    finally:
        method.close()


def pool_tokens(config: dict, args, attention: str) -> int | None:
    """The slots of the pool of an engine started with ``attention``: --kv-cache-tokens tokens' bytes of K and V,
    of which the selection keys' copy, when the engine makes one, takes its share (N * 2kv / (2kv + copy) tokens);
    None, the engine's default pool, which counts the copy already."""
    if args.kv_cache_tokens is None:
        return None
    device = resolve_device(args.device)
    kv_dtype = pool_dtype(args.kv_dtype, resolve_dtype("auto", device))  # the engine's model dtype: LLM.random's auto
    select = selection_keys_dtype(args.select_dtype, attention, kv_dtype, device, "none")
    kv, copy = token_bytes(ModelConfig.from_dict(config), kv_dtype, select)
    return args.kv_cache_tokens * 2 * kv // (2 * kv + copy)


def run_all(config: dict, policies: list[str], batches: list[int], args) -> Iterator[dict]:
    if "dense" in policies:
        yield from run_dense(config, batches, args)
    engine_policies = [p for p in policies if p != "dense"]
    if not engine_policies:
        return
    for group in e2e.engine_groups(engine_policies, args.select_dtype):
        start, first = time.perf_counter(), policy_spec(group[0])[0]
        llm = LLM.random(config, first, device=args.device, kv_dtype=args.kv_dtype,
                         select_dtype=args.select_dtype, kv_cache_tokens=pool_tokens(config, args, first),
                         chunk_size=args.chunk_size, kernels=args.kernels, cuda_graphs=args.cuda_graphs,
                         weight_dtype=args.weight_dtype,
                         prefix_cache=False)  # the warm-up's prompt is the first request's: it would be reused
        print(f"engine with a {llm.cache.n_slots}-slot KV pool built in {time.perf_counter() - start:.1f} s",
              flush=True)
        for policy in group:
            yield from run_policy(llm, config, policy, batches, args)
        del llm
        e2e.free_memory()


# ---- the report -----------------------------------------------------------------------------------------------

def best_dense(rows: list[dict]) -> dict[int, dict]:
    """Batch size -> the fastest dense-family row measured at it (the ratios' reference: the dense baseline or the
    engine's full attention)."""
    best: dict[int, dict] = {}
    for r in rows:
        if "error" not in r and (r["policy"] == "dense" or policy_spec(r["policy"])[0] == "full"):
            if r["batch"] not in best or r["tokens_s"] > best[r["batch"]]["tokens_s"]:
                best[r["batch"]] = r
    return best


def table(rows: list[dict], policies: list[str]) -> str:
    """Markdown: a row per batch size and policy, with the ratio against the best dense row at that batch size."""
    best = best_dense(rows)
    order = {p: i for i, p in enumerate(policies)}
    lines = ["| batch | policy | KV | ms/step | tokens/s | x best dense | one-graph steps | peak GB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["batch"], order.get(r["policy"], len(order)))):
        batch = f"{r['batch']} (largest that fits)" if r["batch"] == r.get("fit_batch") else str(r["batch"])
        if "error" in r:
            lines.append(f"| {batch} | {r['policy']} | {r.get('kv', '')} | {r['error']} | | | | |")
            continue
        ref = best.get(r["batch"])
        x = f"{r['tokens_s'] / ref['tokens_s']:.2f}x ({ref['policy']})" if ref else "dense n/a"
        whole = f"{r['whole_graph_steps']}/{r['steps']}" if r.get("whole_graph_steps") is not None else "-"
        peak = f"{r['peak_gb']:.1f}" if r.get("peak_gb") is not None else "-"
        lines.append(f"| {batch} | {r['policy']} | {r['kv']} | {r['ms_step']:.2f} | {r['tokens_s']:.1f} | {x} "
                     f"| {whole} | {peak} |")
    return "\n".join(lines)


def fits(rows: list[dict], policies: list[str]) -> str:
    """The largest batch each method fits, how many requests it held (prefilled once, then dropped) and how long
    their prefill took."""
    parts = []
    for policy in policies:
        mine = [r for r in rows if r["policy"] == policy]
        if mine:  # its last row that held requests, else its first
            r = next((r for r in reversed(mine) if "held" in r), mine[0])
            held = (f", held {r['held']} (prefill {r['prefill_s']:.1f} s, one request at a time)" if "held" in r
                    else "")
            parts.append(f"- {policy}: {r['fit_batch']} requests{held}")
    return "\n".join(parts)


def plot(rows: list[dict], path: Path) -> None:
    """Decode tokens/s against batch size, a line per policy (measured rows only)."""
    from ..eval.plots import plt, save_png  # matplotlib, with its file backend

    fig, ax = plt.subplots(figsize=(6, 4))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        ok = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["batch"])
        ax.plot([r["batch"] for r in ok], [r["tokens_s"] for r in ok], marker="o", label=policy)
    ax.set_xscale("log", base=2)
    sizes = sorted({r["batch"] for r in rows})
    ax.set_xticks(sizes, [str(b) for b in sizes])
    ax.set_xlabel("requests decoded together")
    ax.set_ylabel("decode tokens/s")
    ax.legend()
    save_png(fig, path)


def write_report(args, config: dict, policies: list[str], rows: list[dict], draw: bool = True) -> str:
    """Write throughput_<tag>.{md,json} and, with ``draw``, the plot (.png) for the rows so far; returns the
    markdown."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    graphs = args.cuda_graphs if args.cuda_graphs is not None else device != "cpu"
    title = (f"{args.config}, {config['num_hidden_layers']} layers, {args.length} tokens a request, KV "
             f"{args.kv_dtype}, selection keys {args.select_dtype}, chunk {args.chunk_size}, {args.decode_steps} "
             f"decode steps a batch size, {'CUDA graphs' if graphs else 'eager'}"
             + (", fp8 weights" if args.weight_dtype == "fp8" else ""))
    budget = (f"the bytes of a {args.kv_cache_tokens}-token KV pool for every method; a copy of the keys for "
              f"selection is paid in tokens" if args.kv_cache_tokens else
              "the KV budget of the engine's default pool for every method")
    report = (f"# Serving throughput: {title}, on {device}\n\n{table(rows, policies)}\n\n"
              f"Largest batch that fits ({budget}):\n{fits(rows, policies)}\n\n"
              "x best dense: tokens/s against the fastest dense or full row at the same batch size. One-graph "
              "steps: timed steps run as one CUDA graph each. Peak GB: the engine's includes its whole KV pool, "
              "allocated up front; dense's the caches of the requests it held. The prefill times above are every "
              f"method's prompts in {args.chunk_size}-token chunks, set up for the decode timing, not a prefill "
              "comparison (`bench e2e` times prefill against the strongest dense configuration).\n")
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"throughput_{args.tag}" if args.tag else "throughput"
    meta = {"device": device, "config": args.config, "layers": config["num_hidden_layers"], "length": args.length,
            "decode_steps": args.decode_steps, "chunk_size": args.chunk_size, "kv_cache_tokens": args.kv_cache_tokens}
    (out / f"{stem}.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    (out / f"{stem}.md").write_text(report)
    measured = [r for r in rows if "error" not in r]
    if measured and draw:
        plot(measured, out / f"{stem}.png")
    return report


def run(args: argparse.Namespace) -> int:
    config = e2e.model_config(args)
    args.length = parse_length(args.length) if isinstance(args.length, str) else args.length
    policies = args.policies.split(",")
    for policy in policies:
        if policy != "dense" and policy_spec(policy)[0] not in POLICIES:
            raise SystemExit(f"unknown policy {policy!r}: use dense or one of {', '.join(POLICIES)}")
    batches = sorted({int(b) for b in args.batch_sizes.split(",")})
    if batches[0] < 1:
        raise SystemExit("batch sizes start at 1")
    rows: list[dict] = []
    report = write_report(args, config, policies, rows)
    for row in run_all(config, policies, batches, args):
        rows.append(row)
        # after every row: a run cut short keeps what it measured (the plot: after every measured row)
        report = write_report(args, config, policies, rows, draw="error" not in row)
    print(report)
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "throughput", help="decode tokens/s of many long requests at once, every policy against dense",
        description="Decode B requests of one long prompt each together, for each batch size and policy, on a "
                    "random-weight model (default Llama-3-8B shape): ms per step, tokens/s, the ratio against "
                    "the fastest dense row of the run at that batch size, and the largest batch each method fits. "
                    "Writes a table, JSON and plot.")
    e2e.add_model_arguments(p)
    p.add_argument("--length", default="32k", help="prompt tokens of every request, e.g. 32k")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32", help="requests decoded together")
    p.add_argument("--policies", default=DEFAULT_POLICIES,
                   help="dense (flash attention over contiguous rotated caches, a decode step one CUDA graph) and "
                        "engine policies, each optionally NAME:KEY=VALUE;... as in bench e2e "
                        f"(default: {DEFAULT_POLICIES})")
    p.add_argument("--decode-steps", type=int, default=16, help="timed decode steps at each batch size")
    p.add_argument("--chunk-size", type=int, default=512,
                   help="every method's prefill chunk (the prompts' prefill, not what is timed)")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8", "bf16"],
                   help="the engine's KV pool (dense keeps the model's dtype)")
    p.add_argument("--weight-dtype", default="auto", choices=["auto", "fp8"],
                   help="fp8: every method's layer matrices in fp8 (the engine's --weight-dtype), dense's too")
    p.add_argument("--select-dtype", default="auto", choices=["auto", "fp8"],
                   help="fp8: TokenSelect scores an fp8 copy of the keys (the engine's --select-dtype)")
    p.add_argument("--kv-cache-tokens", type=int,
                   help="KV budget of every method, in tokens (default: the engine's pool in the free GPU memory)")
    p.add_argument("--kernels", choices=["triton", "torch"],
                   help="the engine's kernels (default: triton on CUDA, the PyTorch references elsewhere)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="run steps through CUDA graphs, dense included (default: on with CUDA)")
    p.add_argument("--device", default=None, help="default: cuda if available")
    p.add_argument("--output", default="benchmarks/results", help="folder for the table, JSON and plot")
    p.add_argument("--tag", default="", help="suffix for the output files")
    p.set_defaults(func=run)

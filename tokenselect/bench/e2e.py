"""``tokenselect bench e2e``: whole-model prefill and decode, every policy against the dense baselines, in one run.

The model is built from a config with random weights (speed does not depend on their values); the
prompt is real English text from the package's corpus, tokenized by the shipped tokenizer. For each
prompt length one engine is built, then every policy runs on it in turn: prefill seconds, decode
ms/token, Selection Cache hit rate, how many prefill chunks and timed decode steps ran as one CUDA graph
each (``cuda_graphs.py``) and peak GPU memory, with ratios against ``dense`` measured in the same run.
Each policy first serves untimed requests of WARMUP_TOKENS tokens (``LLM.warm_up``), so kernel compilation is
not timed.

Random weights' queries are not a real model's, so their Selection Cache hit rate says nothing about
real text (at theta 0.9 it is 0). For a policy with a Selection Cache the bench therefore also runs the
shipped model (trained weights) with the row's settings over the same prose prompt and length, and
reports its hit rate ("real text"): the decode rows with every layer selecting and with the cache always
reusing (theta=-1) bracket a real model's step, which lies between them according to that rate.

The baselines run on the same weights: ``dense`` is attention as a conventional engine runs it
(``bench/dense.py``: keys rotated once when cached, a contiguous cache, SDPA by cuDNN on Hopper and flash
elsewhere, ``dense:sdpa=flash`` or ``cudnn`` to name one; on CUDA each decode step one CUDA graph, flash attention
reading the key length on the device), prefilling in ``--chunk-size`` chunks, ``dense:chunk=N`` in chunks of N and
``dense:chunk=all`` in one pass (settings joined by ``;``: ``dense:chunk=all;sdpa=flash``); ``transformers`` is Hugging
Face transformers' own model and SDPA (``bench/hf_dense.py``: one-pass prefill, decode over its
DynamicCache), what users run today. Every ratio is against the fastest baseline of the run at that
length, prefill and decode each against their own. ``full`` is the engine's own full-attention policy
(paged cache, RoPE applied on the fly), which is what long-context extrapolation runs on.

Each row also carries its decode step's memory floor (``floors.py``: the bytes it must read over the copy
bandwidth measured at the start of the run), its prefill's compute floor (the matrix products' FLOPs over the bf16
matrix rate measured then) and, with ``--hit-rate``, an estimated row for a model whose
Selection Cache reuses that share of its lookups (a mix of the selecting row and the hit path's).

``--kv-offload values`` keeps the V pool in pinned host memory (K stays on the GPU), which is what
lets a 1M-token cache of the Llama-3-8B shape fit one 80 GB GPU. Full attention then reads every
value of the context from the host for every chunk and layer; where that adds up to more than
FULL_OFFLOAD_BYTES it is reported as skipped rather than run. ``--profile-steps N`` runs the last N
prefill chunks and N extra decode steps under torch.profiler and writes the top operations.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from ..config import ModelConfig
from ..data import default_model_path, prose_text
from ..engine import KV_DTYPES, LLM, auto_fp8_keys, kv_label, token_bytes
from ..eval.runner import parse_length
from ..kv_cache import HostMemoryError
from ..models import load_tokenizer
from ..models.loader import resolve_device
from ..parallel import SELECTIONS
from ..policies import POLICIES, PolicyStats, default_chunk, policy_spec
from ..policies.tokenselect import TokenSelectSettings
from ..sampling import SamplingParams
from ..settings import CHUNK_ATTENTION
from .dense import SDPA_CHOICES, DenseRunner
from .floors import (copy_bandwidth, decode_floor, kernel_times, matmul_rate, prefill_flops, profile_parts, sync,
                     timed)
from .hf_dense import measure_transformers, transformers_model

LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "max_position_embeddings": 8192, "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
}
TINY = {**LLAMA3_8B, "vocab_size": 8192, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 1024}
# Qwen2.5-0.5B's shape (the eval tables' Qwen2.5-Coder-0.5B): 14 query heads over 2 kv heads, q/k/v bias, 32K window
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
    "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32768,
    "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
}
CONFIGS = {"llama3-8b": LLAMA3_8B, "qwen2.5-0.5b": QWEN25_05B, "tiny": TINY}
# the strongest dense prefills (8192-token chunks, the one pass) beside the engine's policies
DEFAULT_POLICIES = "dense:chunk=8192,dense:chunk=all,full,streaming,infllm,tokenselect"
FULL_OFFLOAD_BYTES = 256 << 30  # host->GPU value copies full attention may make in one prefill
PROGRESS_SECONDS = 30  # prefill progress lines at most this often
# prompt of the untimed request each policy runs first (the whole prompt when it is shorter). Triton compiles a
# kernel again when an integer argument first becomes divisible by 16: a 16K warm-up left such compiles inside the
# first timed 32K prefill. Arguments that grow with the context should not be specialized (the top-k's block
# count is not: it cost the first 128K prefill after this warm-up 0.6 s, benchmarks/first_prefill_compiles_gpu.py)
WARMUP_TOKENS = 40960
# its decode steps: Triton compiles a kernel again for a length argument divisible by 16 (and for 1), so 16
# consecutive lengths meet every variant an eagerly planned decode step (InfLLM's) launches
WARMUP_DECODE_STEPS = 17


@functools.lru_cache(maxsize=1)
def prose_ids() -> tuple[int, ...]:
    """The corpus's prose as token ids of the shipped tokenizer, tokenized once a process (every length's
    dense run, engine run and real-text run reads it)."""
    return tuple(load_tokenizer(default_model_path())(prose_text()[:4_000_000])["input_ids"])


def text_prompt(n: int, vocab: int | None) -> list[int]:
    """n token ids of real prose by the shipped tokenizer (repeated if the corpus is shorter), folded into a
    vocabulary of ``vocab`` ids (None: the tokenizer's own ids)."""
    ids = list(prose_ids())
    if vocab is not None:
        ids = [i % vocab for i in ids]
    return (ids * (n // len(ids) + 1))[:n]


def free_memory() -> None:
    """Collect what was dropped and hand the GPU's cached blocks back, before the next thing is measured."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def profiled(llm, done: Callable[[], bool], parts: Callable | None = None) -> str:
    """Run engine steps until ``done()`` under torch.profiler -> the operations that took the most host time and
    the kernels that took the most device time (``floors.kernel_times``), as two tables. parts(kernels, steps) ->
    text: a table of the device time by part against its floor, put first."""
    from torch.profiler import ProfilerActivity, profile

    cuda = llm.device.type == "cuda"
    sync(llm.device)
    passes = llm.runner.passes
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        while not done():
            llm.step()
        sync(llm.device)
    steps = llm.runner.passes - passes  # queued in the window, which ends when they have run
    tables = [prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)]
    if cuda:
        kernels = sorted(kernel_times(prof.events()), key=lambda k: -k.self_device_time_total)
        tables.append("\n".join(["| kernel (from the end of the one before) | device ms a step |", "|---|---|"] +
                                 [f"| `{k.key[:90]}` | {k.self_device_time_total / 1e3 / steps:.3f} |"
                                  for k in kernels[:30]]))
        if parts is not None:
            tables.insert(0, parts(kernels, steps))
    return "\n".join(tables)


def warm_up(llm, ids: list[int]) -> None:
    """Untimed short requests (``LLM.warm_up``: prefill past the selection threshold, then decode; then a prompt
    ending inside a chunk), so that kernel compilation (Triton JIT, once per kernel variant) stays out of the timed
    runs."""
    llm.warm_up(ids[:WARMUP_TOKENS], WARMUP_DECODE_STEPS)


def whole_steps(llm, since: int | None = 0) -> int | None:
    """Steps the engine ran as one whole-step graph (``cuda_graphs.py``) after ``since`` of them; None
    without CUDA graphs."""
    return None if llm.runner.graphs is None else llm.runner.graphs.whole_steps - since


def measure(llm, ids: list[int], decode_steps: int, profile_steps: int = 0, label: str = "",
            floor_at: Callable[[float | None], dict | None] | None = None, bandwidth: float | None = None) -> dict:
    """Prefill the prompt, then decode ``decode_steps`` tokens, timing each phase. With
    ``profile_steps``, the last that many prefill chunks (inside the prefill time) and as many decode
    steps after the timed ones run under the profiler: its tables come back under "profile", the decode's
    with its device time by part against ``floor_at(hit rate)`` (``floors.decode_floor``) at ``bandwidth``."""
    dev = llm.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    before = llm.policy.stats() or PolicyStats()
    # a token more than the steps read: the engine queues each decode step before it reads the one before
    # (``overlap_decode``), so the timed window's last step queues one more, whose pass the window's end waits
    # for; the window holds decode_steps passes either way (the profile counts the passes it queued)
    params = SamplingParams(max_tokens=decode_steps + 3 + profile_steps, temperature=0, ignore_eos=True)
    seq = llm.add_request(ids, params)
    chunks_whole = whole_steps(llm)
    sync(dev)
    start = shown = time.perf_counter()
    while len(ids) - seq.n_cached > profile_steps * llm.chunk_size:
        llm.step()
        if time.perf_counter() - shown > PROGRESS_SECONDS:
            shown = time.perf_counter()
            print(f"  {label} prefill {seq.n_cached}/{len(ids)} tokens, {shown - start:.0f} s", flush=True)
    profile = {}
    if profile_steps:
        profile["prefill"] = profiled(llm, lambda: bool(seq.output_ids))
    while not seq.output_ids:
        llm.step()
    sync(dev)
    prefill = time.perf_counter() - start
    chunks_whole = whole_steps(llm, since=chunks_whole)
    llm.step()  # untimed: the first decode step at this length records its CUDA graph (cuda_graphs.py)
    sync(dev)
    whole = whole_steps(llm)
    kept_before = llm.cache.kept_counts() if llm.cache.offload == "values" else None
    start = time.perf_counter()
    while len(seq.output_ids) <= decode_steps + 1:
        llm.step()
    sync(dev)
    decode = (time.perf_counter() - start) / decode_steps
    whole = whole_steps(llm, since=whole)
    values_kept = None  # of the values the timed steps staged, the share found on the device (``KVCache.stage``)
    if kept_before is not None:
        staged, found = (b - a for a, b in zip(kept_before, llm.cache.kept_counts()))
        values_kept = found / staged if staged else None
    after = llm.policy.stats() or PolicyStats()
    counted = after - before
    if profile_steps:
        def parts(events, steps: int) -> str:
            hits = (llm.policy.stats() or PolicyStats()) - after
            looked_up = hits.selection_cache_hits + hits.selection_cache_misses
            floor = floor_at(hits.selection_cache_hits / looked_up if looked_up else None) if floor_at else None
            return f"Device time a step by part, against the floor at {bandwidth / 1e9:,.0f} GB/s:\n\n" + \
                profile_parts(events, steps, floor, bandwidth) + "\n"

        profile["decode"] = profiled(llm, lambda: seq.finished, parts if bandwidth else None)
    if not seq.finished:
        llm.abort(seq)  # the token it may still want, and the step queued for it
    hits, misses = counted.selection_cache_hits, counted.selection_cache_misses
    row = {
        "prefill_s": prefill,
        "decode_ms": decode * 1e3,
        "hit_rate": hits / (hits + misses) if hits + misses else None,
        "whole_graph_steps": whole,  # of the timed decode steps, those run as one graph (cuda_graphs.py)
        "decode_steps": decode_steps,
        "whole_graph_chunks": chunks_whole,  # of the prompt's chunks, those run as one graph
        "prefill_chunks": -(-len(ids) // llm.chunk_size),
        "peak_gb": torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else None,
        "values_kept": values_kept,
    }
    return {**row, "profile": profile} if profile else row


def real_text_hit_rate(settings: dict, ids: list[int], decode_steps: int, args) -> float | None:
    """The Selection Cache's hit rate over ``decode_steps`` greedy tokens of the shipped model (trained weights,
    its own window's default sizes, the run's KV and selection-key dtypes) with the row's TokenSelect
    ``settings`` after the prompt ``ids`` (token ids of the shipped tokenizer); None if no decode step looked the
    cache up."""
    llm = LLM(None, "tokenselect", device=args.device, kernels=args.kernels, cuda_graphs=args.cuda_graphs,
              kv_dtype=args.kv_dtype, select_dtype=args.select_dtype, kv_cache_tokens=len(ids) + decode_steps + 8,
              weight_dtype=args.weight_dtype, **settings)
    llm.generate([ids], SamplingParams(max_tokens=decode_steps + 1, temperature=0, ignore_eos=True))
    stats = llm.stats()
    del llm  # its pool and graphs, before the next row is timed
    free_memory()
    looked_up = stats["selection_cache_hits"] + stats["selection_cache_misses"]
    return stats["selection_cache_hits"] / looked_up if looked_up else None


def full_offload_bytes(llm, length: int) -> int:
    """Bytes of values full attention copies from host memory in one prefill of ``length`` tokens
    with value offload: each chunk, in each layer, gathers the values of the whole context so far."""
    chunk = llm.chunk_size
    row = token_bytes(llm.config, llm.kv_dtype, llm.kv_dtype)[0]
    return row * sum(min(start + chunk, length) for start in range(0, length, chunk))


DENSE = ("dense", "transformers")  # the baselines: rows without an engine policy


def dense_settings(spec: str, length: int, default: int) -> tuple[int, str]:
    """The prefill chunk and SDPA backend of a dense row: ``dense`` (the run's --chunk-size, ``sdpa=auto``),
    ``dense:chunk=8192``, ``dense:chunk=all`` (the whole prompt in one pass), ``dense:sdpa=flash`` (or cudnn, auto:
    ``dense.sdpa_backend``), both as ``dense:chunk=all;sdpa=flash``."""
    name, settings = policy_spec(spec)
    if name != "dense" or set(settings) - {"chunk", "sdpa"}:
        raise ValueError(f"{spec!r}: dense takes chunk=N or chunk=all, and sdpa={'|'.join(SDPA_CHOICES)}")
    chunk, sdpa = settings.get("chunk", default), settings.get("sdpa", "auto")
    if sdpa not in SDPA_CHOICES:
        raise ValueError(f"{spec!r}: sdpa must be one of {', '.join(SDPA_CHOICES)}")
    if chunk == "all":
        return length, sdpa
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"{spec!r}: chunk must be a positive number of tokens or 'all'")
    return chunk, sdpa


def chunk_label(chunk_size: int | None, config: dict) -> str:
    """The title's prefill chunk: the run's --chunk-size, or the engine's defaults on this model (TokenSelect's own
    where its prefill groups make it another)."""
    if chunk_size:
        return f"chunk {chunk_size}"
    window, group = ModelConfig.from_dict(config).window, TokenSelectSettings().prefill_group
    plain, grouped = default_chunk(window), default_chunk(window, group)
    return f"chunk {plain}" + (f" (TokenSelect {grouped}, in groups of {group})" if grouped != plain else "")


def measure_dense(config: dict, ids: list[int], args, chunk: int, sdpa: str = "auto") -> dict:
    """Prefill (in chunks of ``chunk`` tokens, attention by the SDPA backend ``sdpa``) and decode with the dense
    baseline on an engine of the same weights (its own KV pool left empty: the contiguous dense cache is the one
    that holds the sequence)."""
    llm = LLM.random(config, "full", device=args.device, kv_cache_tokens=16, chunk_size=args.chunk_size,
                     cuda_graphs=args.cuda_graphs, weight_dtype=args.weight_dtype)
    dev = llm.device
    warm = DenseRunner(llm, WARMUP_TOKENS + 2, sdpa=sdpa)
    warm.generate(ids[:WARMUP_TOKENS], min(chunk, WARMUP_TOKENS), 2)  # compile, warm up
    runner = DenseRunner(llm, len(ids) + args.decode_steps + 2, sdpa=sdpa)
    runner.build_plans(ids, chunk)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    token, prefill = timed(dev, lambda: runner.prefill(ids, chunk).argmax())
    token = runner.forward(token.reshape(1)).argmax()  # untimed, as the policies' first decode step
    sync(dev)
    start = time.perf_counter()
    for _ in range(args.decode_steps):
        token = runner.forward(token.reshape(1)).argmax()
    sync(dev)
    decode = (time.perf_counter() - start) / args.decode_steps
    return {"kv": kv_label(llm.dtype, "none"), "prefill_s": prefill, "decode_ms": decode * 1e3, "hit_rate": None,
            "chunk": chunk, "sdpa": runner.sdpa,
            "peak_gb": torch.cuda.max_memory_allocated(dev) / 1e9 if dev.type == "cuda" else None}


def measure_hf(config: dict, ids: list[int], args) -> dict:
    """Hugging Face transformers on the same weights (``hf_dense.py``): the prompt in one SDPA pass, decode over
    its DynamicCache; an untimed warm-up request first."""
    llm = LLM.random(config, "full", device=args.device, kv_cache_tokens=16, cuda_graphs=False)
    model = transformers_model(llm, config)
    measure_transformers(model, ids[:WARMUP_TOKENS], 2)
    if llm.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(llm.device)
    row = measure_transformers(model, ids, args.decode_steps)
    del row["tokens"]
    return {**row, "kv": kv_label(llm.dtype, "none"), "hit_rate": None, "chunk": len(ids),
            "peak_gb": torch.cuda.max_memory_allocated(llm.device) / 1e9 if llm.device.type == "cuda" else None}


def matrix_bytes(args) -> int | None:
    """Bytes of a layer matrix's element where the run's weights differ from the model's dtype: 1 with fp8."""
    return 1 if args.weight_dtype == "fp8" else None


def with_floor(row: dict, config: dict, bandwidth: float | None, weight_bytes: int = 2, kv_bytes: int = 2,
               select_bytes: int | None = None, matrix_bytes: int | None = None) -> dict:
    """The row with its decode step's memory floor at its measured hit rate (``floors.decode_floor``; weight_bytes,
    kv_bytes, select_bytes, matrix_bytes: bytes of an element of the weights, the KV pool, the selection keys and,
    where they differ from the weights' (fp8 weights), the layers' matrices):
    "floor_ms" and the bytes by part under "floor"; unchanged where no floor applies (no bandwidth measured,
    an error, values in host memory, several GPUs, a policy without a floor)."""
    if bandwidth is None or "error" in row or "V on host" in row.get("kv", "") or row.get("tensor_parallel_size", 1) > 1:
        return row
    floor = decode_floor(config, row.get("settings"), row["length"], bandwidth, weight_bytes, kv_bytes, select_bytes,
                         row.get("hit_rate"), matrix_bytes_each=matrix_bytes)
    return row if floor is None else {**row, "floor_ms": floor["floor_ms"], "floor": floor}


def with_prefill_floor(row: dict, config: dict, rate: float | None, weight_rate: float | None = None) -> dict:
    """The row with its prefill's compute floor (``floors.prefill_flops`` over ``rate``, the run's matrix FLOP/s,
    and the weights' products over ``weight_rate`` where it is another: fp8 weights'): "prefill_floor_s" and the
    FLOPs by part under "prefill_flops"; unchanged where no floor applies (no rate measured, an error, several
    GPUs, a policy without a floor)."""
    if rate is None or "error" in row or row.get("tensor_parallel_size", 1) > 1:
        return row
    flops = prefill_flops(config, row.get("settings"), row["length"], row["chunk"])
    if flops is None:
        return row
    return {**row, "prefill_floor_s": flops["matmuls"] / (weight_rate or rate) + flops["attention"] / rate,
            "prefill_flops": flops}


def run_dense(config: dict, length: int, spec: str, args, bandwidth: float | None = None,
              rate: float | None = None) -> dict:
    """A baseline's row: ``dense[:chunk=N|all]`` or ``transformers``."""
    row = {"length": length, "policy": spec, "kv": "bf16", "weights": args.weight_dtype}
    ids = text_prompt(length, config["vocab_size"])
    try:
        row.update(measure_hf(config, ids, args) if spec == "transformers"
                   else measure_dense(config, ids, args, *dense_settings(spec, length, args.chunk_size or default_chunk(
                       ModelConfig.from_dict(config).window))))
    except torch.OutOfMemoryError:
        row["error"] = "does not fit on the GPU (bf16 contiguous KV cache)"
    size = KV_DTYPES[row["kv"]].itemsize
    row = with_floor(row, config, bandwidth, size, size, matrix_bytes=matrix_bytes(args))
    row = with_prefill_floor(row, config, rate, args.weight_rate)
    free_memory()
    print(json.dumps(row), flush=True)
    return row


def run_length(config: dict, length: int, policies: list[str], args, bandwidth: float | None = None,
               rate: float | None = None) -> Iterator[dict]:
    """Each policy's row for prompts of ``length`` tokens, yielded as soon as it is measured: the baselines
    first, on their own caches, then the engine's policies (``engine_groups``). bandwidth: the device's copy
    bandwidth (bytes/s), for the rows' decode floors; rate: its matrix FLOP/s, for their prefill floors."""
    for spec in [p for p in policies if policy_spec(p)[0] in DENSE]:
        yield run_dense(config, length, spec, args, bandwidth, rate)
    for group in engine_groups([p for p in policies if policy_spec(p)[0] not in DENSE], args.select_dtype):
        yield from run_engine(config, length, group, args, bandwidth, rate)


def engine_groups(policies: list[str], select_dtype: str) -> list[list[str]]:
    """The engine policies split by the selection keys that ``select_dtype`` gives them when an engine starts
    with them (``engine.selection_keys_dtype``: with "auto", TokenSelect's fp8 copy), in their order: one engine
    each, so that a row measures what a user starting with its policy gets, and other rows neither write nor hold
    a copy they never read."""
    groups: dict[bool, list[str]] = {}
    for policy in policies:
        groups.setdefault(auto_fp8_keys(select_dtype, policy_spec(policy)[0]), []).append(policy)
    return list(groups.values())


def run_engine(config: dict, length: int, policies: list[str], args, bandwidth: float | None,
               rate: float | None = None) -> Iterator[dict]:
    """One engine, started with the first of ``policies`` (whose selection keys it then holds), for prompts of
    ``length`` tokens; yields each policy's row as soon as it is measured."""
    start = time.perf_counter()
    try:
        slots = length + max(args.decode_steps + args.profile_steps, WARMUP_DECODE_STEPS) + 8
        llm = LLM.random(config, policy_spec(policies[0])[0], device=args.device, kv_dtype=args.kv_dtype,
                         kv_offload=args.kv_offload, select_dtype=args.select_dtype, kv_cache_tokens=slots,
                         chunk_size=args.chunk_size, kernels=args.kernels, chunk_attention=args.chunk_attention,
                         cuda_graphs=args.cuda_graphs, weight_dtype=args.weight_dtype,
                         prefix_cache=False,  # the timed prompt starts with the warm-up's: it would be reused
                         tensor_parallel_size=args.tensor_parallel_size, tp_selection=args.tp_selection)
    except (torch.OutOfMemoryError, HostMemoryError) as e:
        where = "on the GPU" if isinstance(e, torch.OutOfMemoryError) else "in host memory"
        for policy in policies:
            yield {"length": length, "policy": policy, "error": f"KV pool does not fit {where}"}
        return
    print(f"{length} tokens: engine with a {llm.cache.n_slots}-slot KV pool (offload {args.kv_offload}) built in "
          f"{time.perf_counter() - start:.1f} s", flush=True)
    ids = text_prompt(length, config["vocab_size"])
    kv = kv_label(llm.kv_dtype, args.kv_offload, llm.select_dtype)
    sizes = llm.dtype.itemsize, llm.kv_dtype.itemsize, llm.select_dtype.itemsize  # with_floor's element bytes
    budget = cudnn_budget(llm)  # the engine's, shared by its policies: each row reads what its own run added
    for policy in policies:
        name, settings = policy_spec(policy)
        llm.set_attention(name, **settings)
        row = {"length": length, "policy": policy, "kv": kv, "weights": args.weight_dtype,
               "settings": llm.policy_config, "chunk": llm.chunk_size, "chunk_attention": llm.chunk_attention,
               "tensor_parallel_size": args.tensor_parallel_size, "tp_selection": args.tp_selection}  # peak_gb: rank 0's GPU (the ranks' shares match)
        cudnn_calls = budget.calls if budget is not None else 0
        copies = full_offload_bytes(llm, length) if name == "full" and args.kv_offload == "values" else 0
        if copies > FULL_OFFLOAD_BYTES:
            row["error"] = f"skipped: would copy {copies / 1e9:,.0f} GB of values from host"
        else:
            try:
                warm_up(llm, ids)

                def floor_at(hit_rate: float | None, row=row) -> dict | None:
                    return with_floor({**row, "hit_rate": hit_rate}, config, bandwidth, *sizes,
                                      matrix_bytes(args)).get("floor")

                row.update(measure(llm, ids, args.decode_steps, args.profile_steps, f"{length}/{policy}", floor_at,
                                   bandwidth))
                row = with_prefill_floor(with_floor(row, config, bandwidth, *sizes, matrix_bytes(args)), config,
                                         rate, args.weight_rate)
                # what ran, not the setting: full attention's and InfLLM's lists have a live length, which the
                # Triton kernel serves whatever chunk_attention says
                row["cudnn_chunks"] = budget is not None and budget.calls > cudnn_calls
                if row["hit_rate"] is not None:
                    row["real_hit_rate"] = real_text_hit_rate(settings, text_prompt(length, None), args.decode_steps,
                                                              args)
            except torch.OutOfMemoryError:
                for seq in list(llm.scheduler.running) + list(llm.scheduler.waiting):
                    llm.abort(seq)
                row["error"] = "out of memory"
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        yield row
    llm.close()  # a tensor-parallel engine's ranks, before the next length's start
    del llm
    free_memory()


def best_dense(rows: list[dict]) -> dict[int, dict]:
    """Length -> {"prefill": row, "decode": row}: the fastest rows at that length that attend every token (the
    baselines, ``DENSE``, and the engine's full attention, whose whole-step graphs may decode faster), each
    phase's own (a one-pass prefill may be fastest while another row decodes fastest)."""
    best: dict[int, dict] = {}
    for r in rows:
        if policy_spec(r["policy"])[0] not in (*DENSE, "full") or "error" in r or r.get("estimated"):
            continue
        b = best.setdefault(r["length"], {"prefill": r, "decode": r})
        if r["prefill_s"] < b["prefill"]["prefill_s"]:
            b["prefill"] = r
        if r["decode_ms"] < b["decode"]["decode_ms"]:
            b["decode"] = r
    return best


def estimated_rows(rows: list[dict], hit_rate: float) -> list[dict]:
    """For each length and KV setting with both a selecting ``tokenselect`` row and its hit path
    (``tokenselect:theta=-1``), the decode step a model reusing ``hit_rate`` of its selections would see: a
    layer that hits skips its scoring, vote and top-k and nothing else, so the step is the mix
    ``hit_rate * hit + (1 - hit_rate) * selecting`` (and likewise its floor). Prefill is the selecting row's."""
    found = {row_key(r): r for r in rows if "error" not in r}
    out = []
    for (length, policy, kv, chunks, weights), select in found.items():
        hit = found.get((length, "tokenselect:theta=-1", kv, chunks, weights))
        if policy != "tokenselect" or hit is None:
            continue
        mix = {"length": length, "policy": f"tokenselect at {hit_rate:.0%} hits (estimate)", "kv": kv,
               "chunk_attention": chunks, "weights": weights, "estimated": True, "prefill_s": select["prefill_s"],
               "hit_rate": hit_rate,
               "decode_ms": hit_rate * hit["decode_ms"] + (1 - hit_rate) * select["decode_ms"],
               "peak_gb": max(select["peak_gb"] or 0, hit["peak_gb"] or 0) or None}
        if select.get("floor_ms") is not None and hit.get("floor_ms") is not None:
            mix["floor_ms"] = hit_rate * hit["floor_ms"] + (1 - hit_rate) * select["floor_ms"]
        if select.get("prefill_floor_s") is not None:
            mix["prefill_floor_s"] = select["prefill_floor_s"]
        out.append(mix)
    return out


def cudnn_budget(llm):
    """The engine's cuDNN plan budget (``kernels.cudnn_attention.PlanBudget``), None where its chunks run on the
    Triton kernel alone."""
    keywords = getattr(llm.kernels.sparse_attention, "keywords", {})
    return keywords.get("cudnn")


def row_label(row: dict) -> str:
    """A row's policy as the table names it; a dense row's with the SDPA backend its prefill ran, an engine row's
    with cuDNN where some of its prefill chunks' attention ran by cuDNN (``cudnn_chunks``; a row measured before
    that was recorded: where ``--chunk-attention`` resolved to cudnn); "fp8 weights" where they were."""
    fp8 = ", fp8 weights" if row.get("weights") == "fp8" else ""
    if row.get("sdpa"):
        return f"{row['policy']} ({row['sdpa']} SDPA{fp8})"
    cudnn = row.get("cudnn_chunks", row.get("chunk_attention") == "cudnn")
    notes = ("cudnn chunks" if cudnn else "") + fp8
    return f"{row['policy']} ({notes.lstrip(', ')})" if notes else row["policy"]


def table(rows: list[dict]) -> str:
    """Markdown table with speedups against the fastest baseline at the same length (``best_dense``: each
    phase against its own fastest), then a line a length naming those baselines."""
    best = best_dense(rows)
    lines = ["| tokens | policy | KV | prefill s | prefill x | prefill floor s | of floor | decode ms/tok | decode x "
             "| decode floor ms | of floor | SC hit rate (real text) | one-graph prefill | one-graph decode | peak GB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        n = f"{r['length'] // 1024}K"
        if "error" in r:
            lines.append(f"| {n} | {r['policy']} | {r.get('kv', '')} | {r['error']} | | | | | | | | | | | |")
            continue
        b = best.get(r["length"])
        px = f"{b['prefill']['prefill_s'] / r['prefill_s']:.2f}x" if b else "dense n/a"
        dx = f"{b['decode']['decode_ms'] / r['decode_ms']:.2f}x" if b else "dense n/a"
        floor, prefill_floor = r.get("floor_ms"), r.get("prefill_floor_s")
        fl, of = ("-", "-") if floor is None else (f"{floor:.2f}", f"{floor / r['decode_ms']:.0%}")
        pfl, pof = (("-", "-") if prefill_floor is None
                    else (f"{prefill_floor:.2f}", f"{prefill_floor / r['prefill_s']:.0%}"))
        hit = f"{r['hit_rate']:.0%}" if r["hit_rate"] is not None else "-"
        if r.get("real_hit_rate") is not None:
            hit += f" ({r['real_hit_rate']:.0%})"
        peak = f"{r['peak_gb']:.1f}" if r.get("peak_gb") is not None else "-"
        whole = f"{r['whole_graph_steps']}/{r['decode_steps']}" if r.get("whole_graph_steps") is not None else "-"
        chunks = (f"{r['whole_graph_chunks']}/{r['prefill_chunks']}" if r.get("whole_graph_chunks") is not None
                  else "-")
        lines.append(f"| {n} | {row_label(r)} | {r.get('kv', '')} | {r['prefill_s']:.2f} | {px} | {pfl} | {pof} "
                     f"| {r['decode_ms']:.2f} | {dx} | {fl} | {of} | {hit} | {chunks} | {whole} | {peak} |")
    kept = [r for r in rows if r.get("values_kept") is not None]
    if best or kept:
        lines.append("")
    for r in kept:
        lines.append(f"V on host, {r['length'] // 1024}K {r['policy']}: {r['values_kept']:.0%} of the values its "
                     "decode steps staged were found on the device (kept from the step before), the rest came over "
                     "the bus.")
    for length, b in best.items():
        lines.append(f"x at {length // 1024}K: prefill against {row_label(b['prefill'])} "
                     f"({b['prefill']['prefill_s']:.2f} s), decode against {row_label(b['decode'])} "
                     f"({b['decode']['decode_ms']:.2f} ms), the fastest dense rows of the run.")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    """Prefill and decode time against prompt length, a line per policy (rows without errors)."""
    from ..eval.plots import plt, save_png  # matplotlib, with its file backend

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        ok = [r for r in rows if r["policy"] == policy]
        for ax, key in zip(axes, ("prefill_s", "decode_ms")):
            ax.plot([r["length"] for r in ok], [r[key] for r in ok], marker="o", label=policy)
    for ax, title in zip(axes, ("prefill (s)", "decode (ms/token)")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_title(title)
        ax.legend()
    save_png(fig, path)


def write_report(args: argparse.Namespace, config: dict, rows: list[dict], bandwidth: float | None = None,
                 rate: float | None = None) -> str:
    """Write the table (.md), the rows (.json), the plot (.png) and any profiles (_profile.txt) of the
    rows so far; returns the table."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    graphs = args.cuda_graphs if args.cuda_graphs is not None else device != "cpu"
    title = (f"{args.config}, {config['num_hidden_layers']} layers, KV {args.kv_dtype}, KV offload {args.kv_offload}, "
             f"selection keys {args.select_dtype}, {chunk_label(args.chunk_size, config)}, {args.decode_steps} "
             f"decode steps, {'CUDA graphs' if graphs else 'eager'}"
             + (", fp8 weights" if getattr(args, "weight_dtype", "auto") == "fp8" else "")
             + (f", tensor parallel over {args.tensor_parallel_size} ({args.tp_selection} selection)"
               if getattr(args, "tensor_parallel_size", 1) > 1 else "")
             + (f", copy bandwidth {bandwidth / 1e9:,.0f} GB/s" if bandwidth else "")
             + (f", bf16 matrix products {rate / 1e12:.3g} TFLOP/s" if rate else ""))
    engines = sorted({r["chunk_attention"] for r in rows if "chunk_attention" in r})
    title += f", the engine's prefill chunk attention by {' and '.join(engines)}" if engines else ""
    return save(Path(args.output), args.tag, title, device, {"config": args.config, "kv_offload": args.kv_offload,
                                                             "copy_bandwidth": bandwidth, "matmul_rate": rate,
                                                             "weight_matmul_rate": getattr(args, "weight_rate", None)},
                rows)


def save(out: Path, tag: str, title: str, device: str, meta: dict, rows: list[dict]) -> str:
    """Write out/e2e_<tag>.{md,json,png} (and _profile.txt) for the rows; returns the markdown."""
    report = f"# End-to-end: {title}, on {device}\n\n{table(rows)}\n"
    out.mkdir(parents=True, exist_ok=True)
    stem = f"e2e_{tag}" if tag else "e2e"
    plain = [{k: v for k, v in r.items() if k != "profile"} for r in rows]
    (out / f"{stem}.json").write_text(json.dumps({"device": device, **meta, "rows": plain}, indent=1))
    (out / f"{stem}.md").write_text(report)
    if any("error" not in r for r in rows):
        plot([r for r in rows if "error" not in r], out / f"{stem}.png")
    profiles = [f"## {r['length']} tokens, {r['policy']}, {phase}\n{text}\n"
                for r in rows for phase, text in r.get("profile", {}).items()]
    if profiles:
        (out / f"{stem}_profile.txt").write_text("\n".join(profiles))
    return report


def merge(args: argparse.Namespace) -> int:
    """One table and plot from the JSON of several runs (e.g. one per length, each a device call of its
    own): rows in order of length, each keeping its own KV setting; dense ratios within each length. A row
    measured again in a later file (same length, policy, KV and chunk attention) replaces the earlier one in place. With
    ``--hit-rate``, estimated rows at that rate are added beside those the runs wrote (replacing a run's own
    estimate at the same rate)."""
    check_hit_rate(args)
    runs = [json.loads(Path(f).read_text()) for f in args.merge]
    devices, configs = {r["device"] for r in runs}, {r["config"] for r in runs}
    if len(devices) > 1 or len(configs) > 1:
        raise SystemExit(f"cannot merge runs of different devices or models: {sorted(devices)}, {sorted(configs)}")
    latest = {row_key(row): row for r in runs for row in r["rows"]}
    rows = sorted(latest.values(), key=lambda row: row["length"])
    if args.hit_rate is not None:  # estimates at another hit rate, from the merged runs' measured rows
        new = estimated_rows([row for row in rows if not row.get("estimated")], args.hit_rate)
        again = {row_key(row) for row in new}  # a run's own estimate at this rate
        rows = [row for row in rows if row_key(row) not in again] + new
    names = ", ".join(Path(f).stem for f in args.merge)
    print(save(Path(args.output), args.tag, f"{configs.pop()}, merged from {names}", devices.pop(),
               {"config": runs[0]["config"], "merged": [Path(f).name for f in args.merge]}, rows))
    return 0


def row_key(row: dict) -> tuple:
    """What makes two rows one measurement, the later replacing the earlier in a merge."""
    return row["length"], row["policy"], row.get("kv"), row.get("chunk_attention"), row.get("weights", "auto")


def check_hit_rate(args: argparse.Namespace) -> None:
    if args.hit_rate is not None and not 0 <= args.hit_rate <= 1:
        raise SystemExit(f"--hit-rate must be between 0 and 1, not {args.hit_rate}")


def run(args: argparse.Namespace) -> int:
    if args.merge:
        return merge(args)
    config = model_config(args)
    policies = args.policies.split(",")
    for policy in policies:
        name = policy_spec(policy)[0]
        if name not in POLICIES and name not in DENSE:
            raise SystemExit(f"unknown policy {policy!r}: use {', '.join(DENSE)} or one of {', '.join(POLICIES)}")
        if name == "dense":
            try:
                dense_settings(policy, 1, args.chunk_size or 1)
            except ValueError as e:
                raise SystemExit(str(e)) from None
    check_hit_rate(args)
    if args.weight_dtype == "fp8" and "transformers" in policies:
        raise SystemExit("the transformers row runs the model's own 16-bit weights: leave it out with "
                         "--weight-dtype fp8")
    lengths = [parse_length(x) for x in args.lengths.split(",")]  # a bad one refused before anything is measured
    device = resolve_device(args.device)
    bandwidth, rate = copy_bandwidth(device), matmul_rate(device)
    args.weight_rate = matmul_rate(device, torch.float8_e4m3fn) if args.weight_dtype == "fp8" else None
    print(f"copy bandwidth {bandwidth / 1e9:,.0f} GB/s (bytes read and written), bf16 matrix products "
          f"{rate / 1e12:.3g} TFLOP/s" + (f", fp8 {args.weight_rate / 1e12:.3g}" if args.weight_rate else "") +
          f" on {device}", flush=True)
    rows = []
    for length in lengths:
        for row in run_length(config, length, policies, args, bandwidth, rate):
            rows.append(row)
            estimates = estimated_rows(rows, args.hit_rate) if args.hit_rate is not None else []
            # after every row, so a run cut short keeps what it measured
            report = write_report(args, config, rows + estimates, bandwidth, rate)
    print(report)
    return 0


def add_model_arguments(p) -> None:
    """--config and --layers: the random-weight model a bench builds (``model_config``)."""
    p.add_argument("--config", default="llama3-8b", help=f"{', '.join(CONFIGS)}, or a config.json path")
    p.add_argument("--layers", type=int, help="override the number of layers (quick runs)")


def model_config(args: argparse.Namespace) -> dict:
    """The Hugging Face config dict of --config (a name of ``CONFIGS`` or a config.json), with --layers layers."""
    config = CONFIGS[args.config] if args.config in CONFIGS else json.loads(Path(args.config).read_text())
    return {**config, "num_hidden_layers": args.layers} if args.layers else config


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "e2e", help="whole-model prefill/decode speed of every policy against the fastest dense baseline",
        description="Time prefill (s) and decode (ms/token) of a random-weight model (default Llama-3-8B "
                    "shape) for each prompt length and policy, and write a table, JSON and plot. Rows with a "
                    "Selection Cache also report its hit rate on real text: the shipped model's, with the row's "
                    "settings, over the same prose prompt.")
    add_model_arguments(p)
    p.add_argument("--lengths", default="32k,128k", help="prompt lengths, e.g. 32k,128k,512k,1m")
    p.add_argument("--policies", default=DEFAULT_POLICIES,
                   help="baselines: dense (SDPA over a contiguous rotated cache, prefill in --chunk-size "
                        "chunks by cuDNN on Hopper, its plan for each chunk shape built by an untimed pass first as "
                        "a server in steady state has them, and flash elsewhere; decode steps as CUDA graphs), "
                        "dense:chunk=N or "
                        "dense:chunk=all (the prompt in one pass), dense:sdpa=flash or dense:sdpa=cudnn (the prefill's "
                        "SDPA backend named; settings joined by ';'), transformers (Hugging Face transformers' SDPA "
                        "on the same weights: one-pass prefill, DynamicCache decode); and engine policies, each "
                        "optionally NAME:KEY=VALUE;... with its own "
                        "settings, e.g. tokenselect:theta=-1 (the Selection Cache always reuses: the hit path's "
                        "speed). Every x is against the fastest baseline of the run at that length, prefill and "
                        "decode each their own (default: " + DEFAULT_POLICIES + ": the dense rows the fastest on an H200 at "
                        "32K-256K, results/e2e_best_dense_h200.md)")
    p.add_argument("--decode-steps", type=int, default=32, help="timed decode steps after each prefill")
    p.add_argument("--hit-rate", type=float, default=None,
                   help="add, where tokenselect and tokenselect:theta=-1 both ran, the decode step of a model whose "
                        "Selection Cache reuses this share of its lookups (an estimate: the mix of the two rows), "
                        "e.g. a real model's rate from an eval table")
    p.add_argument("--chunk-size", type=int, default=None,
                   help="every row's prefill chunk (default: each policy's engine default, dense's 512)")
    p.add_argument("--kv-dtype", default="auto", choices=["auto", "fp8", "bf16"],
                   help="the engine's KV pool (auto: the model's dtype; dense keeps the model's dtype)")
    p.add_argument("--weight-dtype", default="auto", choices=["auto", "fp8"],
                   help="fp8: every row's layer matrices in fp8 (the engine's --weight-dtype), the dense rows' too; "
                        "their prefill floors at the fp8 product's measured rate")
    p.add_argument("--kv-offload", default="none", choices=["none", "values"],
                   help="values: V pool in pinned host memory, K on the GPU (what fits 1M tokens of Llama-3-8B)")
    p.add_argument("--select-dtype", default="auto", choices=["auto", "fp8"],
                   help="fp8: TokenSelect scores an fp8 copy of the keys (the engine's --select-dtype)")
    p.add_argument("--profile-steps", type=int, default=0,
                   help="profile the last N prefill chunks and N extra decode steps (writes <stem>_profile.txt)")
    p.add_argument("--kernels", choices=["triton", "torch"],
                   help="the engine's kernels (default: triton on CUDA, the PyTorch references elsewhere)")
    p.add_argument("--chunk-attention", default="auto", choices=CHUNK_ATTENTION,
                   help="the engine's prefill chunk attention (its --chunk-attention): cudnn on Hopper by default")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="run steps through CUDA graphs captured around attention, dense included (default: on with CUDA)")
    p.add_argument("--device", default=None, help="default: cuda if available")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the engine's model across this many GPUs (docs/tensor_parallel.md); dense stays on one")
    p.add_argument("--tp-selection", default="global", choices=SELECTIONS,
                   help="with --tensor-parallel-size > 1: global (the vote over heads spans every rank, an all-reduce "
                        "a layer) or local (each rank votes over its own heads)")
    p.add_argument("--output", default="benchmarks/results", help="folder for the table, JSON and plot")
    p.add_argument("--tag", default="", help="suffix for the output files")
    p.add_argument("--merge", nargs="+", metavar="JSON",
                   help="measure nothing: write one table and plot from the .json files of earlier runs")
    p.set_defaults(func=run)

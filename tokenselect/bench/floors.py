"""How far a decode step is from the memory floor: the bytes it must read, and the time they take.

A long-context decode step at batch 1 is bound by memory traffic, so its floor is the bytes it must read
over the device's copy bandwidth (measured in the same run, ``copy_bandwidth``). What a step must read:

- the weights: every matrix of every layer and the output head (``weight_bytes``; the input embedding is one
  row a token and is left out unless the head shares it);
- its attention, each layer (``attention_bytes``): the keys and values it attends, and for a step that
  selects, the selection keys it scores (TokenSelect: every middle token's key; InfLLM: each block's
  representative keys). A Selection Cache hit scores nothing.

Scratch a kernel writes and reads back (the vote's per-head scores, say) is not in the floor: a fused kernel
would not need it. The profile's device time is split into the same parts (``profile_parts``) so that each
is set against its own floor, and what has no floor (small kernels: norms, the vote, the top-k, copies) shows
as the time it adds. A kernel's time there runs from when the kernel before it ended (``kernel_times``): on Hopper
our kernels start before their predecessor has finished and wait for it (``kernels/launch.py``), and that wait is
the predecessor's time, not theirs.

A prefill is bound by arithmetic instead, so its floor is the matrix products' FLOPs over the device's measured
bf16 matrix rate (``matmul_rate``, the practical peak of the units both the GEMMs and attention run on): every
matrix of every layer for each prompt token (the output head for the last one), and attention's query-key pairs,
each query its context (``context_tokens``) and its chunk's tokens up to itself (``prefill_flops``). What is not a
matrix product (norms, the selection's scoring reads, the KV write) is left out, so it is a lower bound.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from functools import partial

import torch

# (part, kernel-name pattern), first match wins; the parts with a floor are "weights", "scoring" and "attention"
PARTS = (
    ("weights", re.compile(r"nvjet|gemm|cutlass|xmma|splitKreduce|cublas", re.I)),
    ("scoring", re.compile(r"_scores_kernel|_block_scores_kernel|_window_mass_kernel")),
    ("vote and top-k", re.compile(r"_head_totals_kernel|_vote_kernel|_histogram_kernel|_count_kernel|_write_kernel")),
    ("attention", re.compile(r"_sparse_attention_kernel|_merge_kernel|_rotate_keys_kernel|flash|fmha", re.I)),
    ("selection cache", re.compile(r"_selection_check_kernel|_selection_update_kernel")),
    ("KV write", re.compile(r"_scatter_kernel")),
    ("norms, activations", re.compile(r"_rms_norm_kernel|_silu_mul_kernel")),
)
OTHER = "other (elementwise, indexing, copies)"


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op off CUDA), so that a host clock times it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, fn):
    """fn() -> (its result, the seconds it took, the device's work included)."""
    sync(device)
    start = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - start


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 30, repeats: int = 10) -> float:
    """Bytes a second a device-to-device copy moves, counting bytes read and written (the issue's 2.96 TB/s
    on an H100). On a CPU a 64 MiB copy."""
    if device.type != "cuda":
        nbytes = min(nbytes, 64 << 20)
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * repeats / (time.perf_counter() - start)


def layer_matrix_params(config: dict) -> int:
    """Elements of one layer's matrices (q, k, v, o, gate, up, down) for a Llama-family config (Hugging Face names)."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    return (hidden * heads * head_dim * 2  # q and o
            + hidden * kv_heads * head_dim * 2  # k and v
            + hidden * inter * 3)  # gate, up, down


def weight_bytes(config: dict, dtype_bytes: int = 2, matrix_bytes: int | None = None) -> int:
    """Bytes of weights a decode token reads, for a Llama-family config (Hugging Face names): the attention and
    MLP matrices (``matrix_bytes`` an element: 1 with fp8 weights; None: dtype_bytes) and norms of every layer,
    the final norm and the output head. Biases (Qwen's q/k/v) and fp8 scales are left out: a few KB a layer."""
    hidden = config["hidden_size"]
    layer = layer_matrix_params(config) * (matrix_bytes or dtype_bytes) + hidden * 2 * dtype_bytes  # and the norms
    return config["num_hidden_layers"] * layer + dtype_bytes * (hidden + config["vocab_size"] * hidden)


def selects(settings: dict | None, cached: int, end: int) -> bool | None:
    """Whether a step after ``cached`` tokens, its last at position ``end - 1``, selects rather than attending
    every token, for a row's fitted policy settings (``LLM.policy_config``; None: dense); None where no floor is
    defined (QUEST, ReAttention). The thresholds are the policies' own ``mode`` (``SelectivePolicy``, ``InfLLM``):
    past the list's capacity (budget == context attends all) and past ``dense_until``."""
    if settings is None or settings["attention"] == "full":
        return False
    if settings["attention"] not in ("streaming", "tokenselect", "infllm"):
        return None
    if "dense_until" in settings:  # None: the model's window (a selective policy's default)
        dense_until = settings["window"] if settings["dense_until"] is None else settings["dense_until"]
        if end <= dense_until:
            return False
    # InfLLM's list holds a remainder of the middle shorter than a block beside its k tokens of whole blocks
    remainder = settings["block_size"] - 1 if settings["attention"] == "infllm" else 0
    return cached > list_tokens(settings) + remainder


def list_tokens(settings: dict) -> int:
    """Cached tokens a selecting step's list holds at the least: the sinks, the window and the k chosen (streaming:
    none; InfLLM: k of whole blocks, its remainder left out)."""
    return settings.get("n_init", 0) + settings.get("n_local", 0) + settings.get("k", 0)


def context_tokens(settings: dict | None, cached: int, end: int) -> int | None:
    """Cached tokens each query of that step (``selects``) attends, the step's own tokens not counted: every one,
    or the list's (``list_tokens``); None where no floor is defined."""
    selecting = selects(settings, cached, end)
    if selecting is None:
        return None
    return list_tokens(settings) if selecting else cached


def attention_tokens(settings: dict | None, length: int) -> tuple[int, int] | None:
    """(tokens attended, selection keys scored) by one layer of a decode step over ``length`` tokens (``length -
    1`` cached and its own) that selects anew, for a row's fitted policy settings (``LLM.policy_config``; None:
    dense); None where no floor is defined (QUEST, ReAttention). A selecting step scores every candidate of the
    middle, the cached tokens between the sinks and the window (TokenSelect: each one's key; InfLLM: each whole
    block's representative keys)."""
    cached = length - 1
    selecting = selects(settings, cached, length)
    if selecting is None:
        return None
    if not selecting:
        return length, 0
    attended, name = list_tokens(settings) + 1, settings["attention"]
    if name == "streaming":
        return attended, 0
    middle = cached - settings.get("n_init", 0) - settings.get("n_local", 0)
    return attended, middle if name == "tokenselect" else middle // settings["block_size"] * settings["repr_keys"]


def prefill_group(settings: dict | None, chunk: int) -> int:
    """The queries that attend one list in a prefill of ``chunk``-token chunks: TokenSelect's ``prefill_group``
    where it splits the chunk (each group attends as a chunk of its size would: ``TokenSelect.prefill_cut``),
    else the chunk."""
    group = (settings or {}).get("prefill_group") or 0
    return group if 0 < group < chunk else chunk


def prefill_pairs(settings: dict | None, length: int, chunk: int) -> int | None:
    """Query-key pairs one layer's attention computes prefilling ``length`` tokens in ``chunk``-token chunks:
    each query its context (``context_tokens`` at its group's start) and its group's tokens up to itself; None
    where no floor is defined."""
    group, pairs = prefill_group(settings, chunk), 0
    for start in range(0, length, group):
        w = min(group, length - start)
        context = context_tokens(settings, start, start + w)
        if context is None:
            return None
        pairs += w * context + w * (w + 1) // 2
    return pairs


def prefill_flops(config: dict, settings: dict | None, length: int, chunk: int) -> dict | None:
    """The matrix products' FLOPs of prefilling ``length`` tokens: {"matmuls" (every layer's matrices for each
    token, the output head for the last), "attention" (QK^T and PV over ``prefill_pairs``), "total"}; None where
    no floor is defined."""
    pairs = prefill_pairs(settings, length, chunk)
    if pairs is None:
        return None
    layers, heads = config["num_hidden_layers"], config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    matmuls = 2 * (length * layers * layer_matrix_params(config) + config["hidden_size"] * config["vocab_size"])
    attention = 4 * head_dim * heads * layers * pairs  # 2 FLOPs a multiply-add, in each of the two products
    return {"matmuls": matmuls, "attention": attention, "total": matmuls + attention}


def matmul_rate(device: torch.device, dtype: torch.dtype = torch.bfloat16, n: int = 8192, repeats: int = 10,
                batches: int = 5) -> float:
    """FLOP/s of an n x n by n x n matrix product in ``dtype`` (float8_e4m3fn: ``torch._scaled_mm``) on the device,
    the best of ``batches`` batches of ``repeats`` (the practical peak of its matrix units: a batch that shared the
    device with other work does not lower it). On a CPU a product of at most 512 in fp32."""
    if device.type != "cuda":
        n, dtype = min(n, 512), torch.float32
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    if dtype == torch.float8_e4m3fn:  # fp8 weights' product: cuBLAS's, one scale an operand (``models/fp8.py``)
        one = torch.ones(1, device=device)
        product = partial(torch._scaled_mm, a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    else:
        out = torch.empty(n, n, device=device, dtype=dtype)
        product = partial(torch.mm, a, b, out=out)
    product()  # the first call's setup is not timed
    best = float("inf")
    for _ in range(batches):
        sync(device)
        start = time.perf_counter()
        for _ in range(repeats):
            product()
        sync(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 * repeats / best


def decode_floor(config: dict, settings: dict | None, length: int, bandwidth: float, weight_bytes_each: int = 2,
                 kv_bytes: int = 2, select_bytes: int | None = None, hit_rate: float | None = None,
                 batch: int = 1, matrix_bytes_each: int | None = None) -> dict | None:
    """The decode step's floor at ``length`` tokens: {"weights", "scoring", "attention", "total"} in bytes and
    {"floor_ms"}; None where ``attention_tokens`` has none. weight_bytes_each: bytes of a weight element
    (matrix_bytes_each: of the layers' matrices, where they differ: fp8 weights);
    kv_bytes: of a K or V element in the pool;
    select_bytes: of a selection key (None: the K pool's); hit_rate: the share of layers whose Selection Cache
    reuses (they score nothing), None for none; batch: sequences of ``length`` tokens decoded together, whose step
    reads the weights once and each sequence's scoring and attention bytes."""
    tokens = attention_tokens(settings, length)
    if tokens is None:
        return None
    attended, scored = tokens
    row = config["num_key_value_heads"] * (config.get("head_dim") or
                                           config["hidden_size"] // config["num_attention_heads"])
    layers = config["num_hidden_layers"]
    parts = {"weights": weight_bytes(config, weight_bytes_each, matrix_bytes_each),
             "scoring": batch * round(layers * scored * row * (select_bytes or kv_bytes) * (1 - (hit_rate or 0))),
             "attention": batch * layers * attended * row * kv_bytes * 2}
    total = sum(parts.values())
    return {**parts, "total": total, "floor_ms": total / bandwidth * 1e3}


@dataclass(frozen=True)
class KernelTime:
    """A device kernel's time in a profile, summed over its runs (us), as ``prof.key_averages()`` names it."""

    key: str
    self_device_time_total: float
    device_type: torch.autograd.DeviceType = torch.autograd.DeviceType.CUDA


def kernel_times(events) -> list[KernelTime]:
    """``prof.events()`` -> each device kernel's (and copy's) time, every run counted from its start or, where it
    started earlier, from the end of the device work before it: a kernel launched dependent on the one before
    (``kernels/launch.py``) is resident early and waits, and the profiler counts the wait as its own. Exact for
    work on one stream, as a decode step's (a run that overlaps another stream's is counted for what it adds)."""
    cuda = torch.autograd.DeviceType.CUDA
    runs = sorted((e.time_range.start, e.time_range.end, e.name) for e in events if e.device_type == cuda)
    totals: dict[str, float] = {}
    ended = float("-inf")
    for start, end, name in runs:
        totals[name] = totals.get(name, 0.0) + max(0.0, end - max(start, ended))
        ended = max(ended, end)
    return [KernelTime(name, us) for name, us in totals.items()]


def profile_parts(events, steps: int, floor: dict | None, bandwidth: float) -> str:
    """A markdown table of a profile's device time a step by part (``PARTS``), each against its floor.
    events: ``kernel_times`` (or ``prof.key_averages()``); only device kernels (not the operators that launched
    them) are counted."""
    times: dict[str, float] = {}
    for e in events:
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA or e.key.startswith(("aten::", "cuda")):
            continue
        part = (OTHER if e.key.startswith(("Memcpy", "Memset"))
                else next((name for name, pattern in PARTS if pattern.search(e.key)), OTHER))
        times[part] = times.get(part, 0.0) + e.self_device_time_total / 1e3 / steps  # ms a step
    # (part, device ms a step, floor ms or None)
    rows = [(name, times[name], floor[name] / bandwidth * 1e3 if floor and floor.get(name) else None)
            for name in [p for p, _ in PARTS] + [OTHER] if name in times]
    rows.append(("all kernels", sum(times.values()), floor["floor_ms"] if floor else None))
    lines = ["| part | device ms a step | floor ms | of floor |", "|---|---|---|---|"]
    for name, ms, floor_ms in rows:
        of = ("-", "-") if floor_ms is None else (f"{floor_ms:.3f}", f"{floor_ms / ms:.0%}")
        lines.append(f"| {name} | {ms:.3f} | {of[0]} | {of[1]} |")
    return "\n".join(lines)

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
as the time it adds.
"""

from __future__ import annotations

import re
import time

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


def weight_bytes(config: dict, dtype_bytes: int = 2) -> int:
    """Bytes of weights a decode token reads, for a Llama-family config (Hugging Face names): the attention and
    MLP matrices and norms of every layer, the final norm and the output head. Biases (Qwen's q/k/v) are left
    out: a few KB a layer."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    layer = (hidden * heads * head_dim * 2  # q and o
             + hidden * kv_heads * head_dim * 2  # k and v
             + hidden * inter * 3  # gate, up, down
             + hidden * 2)  # the two norms
    return dtype_bytes * (config["num_hidden_layers"] * layer + hidden + config["vocab_size"] * hidden)


def attention_tokens(settings: dict | None, length: int) -> tuple[int, int] | None:
    """(tokens attended, selection keys scored) by one layer of a decode step over ``length`` tokens (those
    cached and its own) that selects anew, for a row's fitted policy settings (``LLM.policy_config``; None:
    dense); None where no floor is defined (QUEST, ReAttention). The thresholds are the policies' own
    (``SelectivePolicy.mode``, ``InfLLM.mode``), with ``length - 1`` tokens cached before the step."""
    if settings is None or settings["attention"] == "full":
        return length, 0
    name, cached = settings["attention"], length - 1
    fixed = settings.get("n_init", 0) + settings.get("n_local", 0)
    if "dense_until" in settings:  # None: the model's window (a selective policy's default)
        dense_until = settings["window"] if settings["dense_until"] is None else settings["dense_until"]
        if length <= dense_until:
            return length, 0
    if name == "streaming":
        return min(length, fixed), 0
    if name in ("tokenselect", "infllm") and cached <= fixed + settings["k"]:
        return length, 0
    if name == "tokenselect":
        return fixed + settings["k"], length - fixed
    if name == "infllm":
        return fixed + settings["k"], (length - fixed) // settings["block_size"] * settings["repr_keys"]
    return None


def decode_floor(config: dict, settings: dict | None, length: int, bandwidth: float, weight_bytes_each: int = 2,
                 kv_bytes: int = 2, select_bytes: int | None = None, hit_rate: float | None = None) -> dict | None:
    """The decode step's floor at ``length`` tokens: {"weights", "scoring", "attention", "total"} in bytes and
    {"floor_ms"}; None where ``attention_tokens`` has none. weight_bytes_each: bytes of a weight element;
    kv_bytes: of a K or V element in the pool;
    select_bytes: of a selection key (None: the K pool's); hit_rate: the share of layers whose Selection Cache
    reuses (they score nothing), None for none."""
    tokens = attention_tokens(settings, length)
    if tokens is None:
        return None
    attended, scored = tokens
    row = config["num_key_value_heads"] * (config.get("head_dim") or
                                           config["hidden_size"] // config["num_attention_heads"])
    layers = config["num_hidden_layers"]
    parts = {"weights": weight_bytes(config, weight_bytes_each),
             "scoring": round(layers * scored * row * (select_bytes or kv_bytes) * (1 - (hit_rate or 0))),
             "attention": layers * attended * row * kv_bytes * 2}
    total = sum(parts.values())
    return {**parts, "total": total, "floor_ms": total / bandwidth * 1e3}


def profile_parts(events, steps: int, floor: dict | None, bandwidth: float) -> str:
    """A markdown table of a profile's device time a step by part (``PARTS``), each against its floor.
    events: ``prof.key_averages()``; only device kernels (not the operators that launched them) are counted."""
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

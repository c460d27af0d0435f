"""``tokenselect bench attention``: one attention layer, our kernels against dense SDPA.

Llama-3-8B attention shape (32 q heads, 8 kv heads, d=128, bf16). For each KV length it times, in
the same run and on the same cache:

- dense chunk / decode: SDPA (flash backend on CUDA) over the whole cache, keys already rotated,
  for a 512-query prefill chunk (causal inside it) and for one decode query;
- ours chunk: head soft vote of the chunk-mean query over the middle of the cache, top-k, and
  sparse attention over [n_init + k + n_local + chunk] slots with RoPE on the fly;
- ours decode miss: the same for one query (vote, top-k, sparse attention);
- ours decode hit: the Selection Cache check (cosine) and sparse attention over the cached list;
- the read-K floor: the bytes of K over the copy bandwidth measured in this run, the least a
  selection that reads every key once can cost.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from ..kernels import get_kernels
from ..rope import RopeSpec, rotate
from .e2e import parse_length


def timer(device: torch.device):
    """-> time(fn) giving the median milliseconds of fn()."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return lambda fn: do_bench(fn, warmup=10, rep=50, return_mode="median")

    import time

    def cpu_time(fn, reps=3):
        fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[reps // 2]

    return cpu_time


def copy_bandwidth(device: torch.device, time) -> float:
    """Bytes per second of a device-to-device copy (read + write counted)."""
    src = torch.empty(256 << 20, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time(lambda: dst.copy_(src))
    return 2 * src.numel() / (ms / 1e3)


def dense(q, k, v, causal_chunk: bool):
    """SDPA over the whole (rotated) cache. q, k, v: [1, H, c or N, d] (kv heads already expanded)."""
    if not causal_chunk:
        return F.scaled_dot_product_attention(q, k, v)
    from torch.nn.attention.bias import causal_lower_right

    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]))


def bench_length(n: int, args, kern, time, bandwidth: float) -> dict:
    dev, dt = torch.device(args.device), torch.bfloat16
    h, h_kv, d, chunk = args.heads, args.kv_heads, args.head_dim, args.chunk
    k_pool = torch.randn(n, h_kv, d, device=dev, dtype=dt)
    v_pool = torch.randn(n, h_kv, d, device=dev, dtype=dt)
    slots = torch.arange(n, device=dev)
    inv_freq, _ = RopeSpec(d, theta=500000.0).inv_freq()
    inv_freq = inv_freq.to(dev)
    q_chunk = torch.randn(chunk, h, d, device=dev, dtype=dt)
    q_one = q_chunk[-1:]
    scale = 1.0

    # dense: the cache rotated once, as a dense engine caches it, kv heads expanded outside the timing
    group = h // h_kv
    k_rot = rotate(k_pool, torch.arange(n, device=dev), inv_freq).repeat_interleave(group, 1).transpose(0, 1)[None]
    v_dense = v_pool.repeat_interleave(group, 1).transpose(0, 1)[None]
    q_rot = rotate(q_chunk, torch.arange(n - chunk, n, device=dev), inv_freq).transpose(0, 1)[None]
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = [SDPBackend.FLASH_ATTENTION] if dev.type == "cuda" else [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(backends):
        dense_chunk = time(lambda: dense(q_rot, k_rot, v_dense, True))
        dense_decode = time(lambda: dense(q_rot[:, :, -1:], k_rot, v_dense, False))
    del k_rot, v_dense

    n_init, n_local, k = args.n_init, args.n_local, args.k
    middle = slots[n_init:n - n_local - chunk]
    past_local = slots[n - n_local - chunk:n - chunk]
    own = slots[n - chunk:]

    def select(query):
        vote = kern.head_soft_vote(query, k_pool, middle, scale)
        return middle[kern.topk(vote, k).sort().values]

    def attend(q, chosen, own_slots):
        listed = torch.cat([slots[:n_init], chosen, past_local, own_slots])
        m = listed.numel()
        return kern.sparse_attention(q, k_pool, v_pool, listed, torch.arange(m, device=dev),
                                     torch.arange(m - q.shape[0], m, device=dev), inv_freq)

    chosen = select(q_chunk.float().mean(0).to(dt))
    ours_chunk = time(lambda: attend(q_chunk, select(q_chunk.float().mean(0).to(dt)), own))
    ours_miss = time(lambda: attend(q_one, select(q_one[0]), own[-1:]))
    cached_q = q_one.flatten().float()
    ours_hit = time(lambda: (F.cosine_similarity(q_one.flatten().float(), cached_q, dim=0) >= 0.9,
                             attend(q_one, chosen, own[-1:])))
    vote_only = time(lambda: kern.head_soft_vote(q_one[0], k_pool, middle, scale))
    votes = kern.head_soft_vote(q_one[0], k_pool, middle, scale)
    topk_only = time(lambda: kern.topk(votes, k))
    floor = k_pool.numel() * k_pool.element_size() / bandwidth * 1e3
    return {
        "kv_tokens": n, "dense_chunk_ms": dense_chunk, "ours_chunk_ms": ours_chunk,
        "dense_decode_ms": dense_decode, "ours_decode_miss_ms": ours_miss, "ours_decode_hit_ms": ours_hit,
        "vote_ms": vote_only, "topk_ms": topk_only, "read_k_floor_ms": floor,
    }


def table(rows: list[dict]) -> str:
    lines = ["| KV tokens | dense chunk ms | ours chunk ms | chunk speedup | dense decode ms | miss ms | miss / floor "
             "| hit ms | hit / dense | vote ms | top-k ms | read-K floor ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['kv_tokens'] // 1024}K | {r['dense_chunk_ms']:.3f} | {r['ours_chunk_ms']:.3f} "
            f"| {r['dense_chunk_ms'] / r['ours_chunk_ms']:.1f}x | {r['dense_decode_ms']:.3f} "
            f"| {r['ours_decode_miss_ms']:.3f} | {r['ours_decode_miss_ms'] / r['read_k_floor_ms']:.2f}x "
            f"| {r['ours_decode_hit_ms']:.3f} | {r['ours_decode_hit_ms'] / r['dense_decode_ms']:.3f}x "
            f"| {r['vote_ms']:.3f} | {r['topk_ms']:.3f} | {r['read_k_floor_ms']:.3f} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    args.device = str(device)
    kern = get_kernels(args.kernels or ("triton" if device.type == "cuda" else "torch"))
    time = timer(device)
    bandwidth = copy_bandwidth(device, time)
    rows = []
    for n in [parse_length(x) for x in args.lengths.split(",")]:
        if n < args.n_init + args.k + args.n_local + args.chunk:
            raise ValueError(f"KV length {n} is shorter than n_init + k + n_local + chunk")
        rows.append(bench_length(n, args, kern, time, bandwidth))
        print(json.dumps(rows[-1]), flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    report = (f"# Attention layer: {args.heads} q heads / {args.kv_heads} kv heads / d={args.head_dim}, bf16, "
              f"k={args.k}, n_init={args.n_init}, n_local={args.n_local}, chunk {args.chunk}, "
              f"{kern.name} kernels, on {name} (copy bandwidth {bandwidth / 1e12:.2f} TB/s)\n\n{table(rows)}\n")
    print(report)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"attention_{args.tag}" if args.tag else "attention"
    (out / f"{stem}.json").write_text(json.dumps({"device": name, "kernels": kern.name,
                                                  "bandwidth_Bps": bandwidth, "rows": rows}, indent=1))
    (out / f"{stem}.md").write_text(report)
    return 0


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "attention", help="one attention layer: selection + sparse attention vs dense SDPA",
        description="Time one Llama-3-8B-shaped attention layer at several KV lengths: dense SDPA against "
                    "TokenSelect (prefill chunk, decode with Selection Cache miss and hit), with the read-K floor.")
    p.add_argument("--lengths", default="32k,128k,512k,1m")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--k", type=int, default=2048)
    p.add_argument("--n-init", type=int, default=128)
    p.add_argument("--n-local", type=int, default=512)
    p.add_argument("--kernels", choices=["triton", "torch"])
    p.add_argument("--device", default=None)
    p.add_argument("--output", default="benchmarks/results")
    p.add_argument("--tag", default="", help="suffix for the output files")
    p.set_defaults(func=run)

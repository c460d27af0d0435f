"""``tokenselect bench attention``: one attention layer, dense against TokenSelect, per KV length.

Shape: Llama-3-8B (32 query heads, 8 kv heads, head_dim 128, bf16) unless told otherwise. For each
KV length L, in one run on one GPU:

- dense chunk: SDPA of a 512-query chunk over all L RoPE'd keys, causal bottom-right (the chunk is the last 512 of
  the L tokens), GQA without copying K/V, by flash and by cuDNN (``dense.causal_attention``: its chunk in two
  calls, context and own keys, merged by log-sum-exp); each dense figure is the faster backend's, named in its cell;
- dense decode: the same for 1 query;
- ours: one engine attention step, as ``attention.attend`` runs it: the TokenSelect policy's list
  (``attend``), sparse attention with RoPE applied on the fly. The list of
  - a chunk: chunk-mean query -> head soft vote over the whole middle of the cache -> top-k ->
    sorted selection -> slot list [n_init, k selected, n_local, own];
  - a decode miss: Selection Cache check (cosine with the cached query, on the device) ->
    vote -> top-k -> store -> list;
  - a decode hit: the same check -> vote and top-k over no live candidate -> the cached choice -> list;
  the policy built and driven through its public API as the engine drives it (``start_step``, ``attend``,
  ``stats``) over a ``KVCache`` of the layer's keys;
- read-K floor: bytes of K the vote must read over the copy bandwidth measured in the same run.

With ``--fp8-select`` the selection also runs over an fp8 (e4m3) copy of the keys, the "read fewer
bytes" variant: rows marked fp8 read that copy for the vote, bf16 K/V for attention.
Times are medians of ``triton.testing.do_bench`` (CUDA events, L2 flushed between runs): each call launched
from the host as the engine's eager prefill launches it, so where a step's kernels are short the host's launches
set its time. On CUDA the steps are also timed captured in a CUDA graph (``graph_us``: the GPU's time alone, the
host's launches gone), dense's too, in the report's first table: what a chunk costs a prefill whose host runs ahead
of the GPU (its GEMMs take far longer than the launches), and a decode step as the engine runs it (one graph).
``--device cpu --tiny`` runs tiny sizes with wall-clock timing: a smoke test of the code path, not a benchmark.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import torch

from ..cuda_graphs import capture, warm_up
from ..eval.runner import parse_length
from ..kernels import chunk_attention_backend, get_kernels, kernels_for
from ..kv_cache import KVCache
from ..models.loader import resolve_device
from ..policies import start_step
from ..policies.tokenselect import TokenSelect
from ..rope import RopeSpec, rotate
from ..settings import CHUNK_ATTENTION
from .dense import causal_attention

DEFAULT_LENGTHS = "32k,128k,512k,1m"
TINY = {"lengths": "2k,4k", "heads": 4, "kv_heads": 2, "head_dim": 32,
        "chunk": 64, "k": 128, "n_init": 16, "n_local": 64}


def timer(device: torch.device):
    """ms(fn) -> median milliseconds of fn()."""
    if device.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")

    def wall(fn, reps: int = 5) -> float:
        fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    return wall


def graph_us(call, calls: int, replays: int) -> float:
    """Microseconds per call of ``call(i)`` for i < calls, captured in one CUDA graph (as a decode step captured as
    one graph runs its per-layer work: the gaps between nodes count): run once on a side stream (compiling and
    warming), captured, then replayed ``replays`` times, timed by the host over all of them."""
    warm_up(lambda: [call(i) for i in range(calls)])
    graph, _ = capture(lambda: [call(i) for i in range(calls)], None)
    return replay_seconds(graph, replays) / calls * 1e6


def replay_seconds(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Seconds per replay of ``graph`` (one untimed first), timed by the host over all of them."""
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / replays


def copy_bandwidth(device: torch.device, ms) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written over the time)."""
    n = (1 << 30) if device.type == "cuda" else (1 << 24)
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t = ms(lambda: dst.copy_(src))
    return 2 * n / (t * 1e-3)


class Layer:
    """One layer's cache of L tokens and a chunk at its end, laid out both ways.

    Ours: pre-RoPE keys and values in a ``KVCache`` of one layer (``caches[fp8]``: with fp8, one that also keeps
    the fp8 copy that selection reads), addressed through a shuffled page table (page = 1 token), as the engine's
    paged pool is. Dense: RoPE'd keys in sequence order, [1, n_kv, L, d]."""

    def __init__(self, L: int, args, device: torch.device):
        h, kv, d = args.heads, args.kv_heads, args.head_dim
        gen = torch.Generator(device=device).manual_seed(L)
        self.args, self.L = args, L
        k = torch.randn(L, kv, d, device=device, dtype=torch.bfloat16, generator=gen)
        v = torch.randn(L, kv, d, device=device, dtype=torch.bfloat16, generator=gen)
        self.caches = {}
        for fp8 in (False, True) if args.fp8_select else (False,):
            self.caches[fp8] = KVCache(1, L, kv, d, torch.bfloat16, device,
                                       select_dtype=torch.float8_e4m3fn if fp8 else None)
            self.caches[fp8].write(0, torch.arange(L, device=device), k, v)
        self.k_pool, self.v_pool = self.caches[False].k[0], self.caches[False].v[0]
        self.page_table = torch.randperm(L, device=device, generator=gen)  # position -> slot
        self.inv_freq = RopeSpec(d, theta=500_000.0).inv_freq()[0].to(device)
        positions = torch.arange(L, device=device)
        k_seq = rotate(self.k_pool[self.page_table], positions, self.inv_freq)  # [L, kv, d] in sequence order
        self.k_dense = k_seq.permute(1, 0, 2).unsqueeze(0)
        self.v_dense = self.v_pool[self.page_table].permute(1, 0, 2).unsqueeze(0)
        self.q = {c: torch.randn(c, h, d, device=device, dtype=torch.bfloat16, generator=gen) for c in (1, args.chunk)}

    def dense(self, c: int, sdpa: str = "flash"):
        """fn() running dense attention of the last c tokens' queries over all L keys by the SDPA backend ``sdpa``
        (``dense.causal_attention``)."""
        q = rotate(self.q[c], torch.arange(self.L - c, self.L, device=self.q[c].device), self.inv_freq)
        q = q.permute(1, 0, 2).unsqueeze(0)  # [1, h, c, d]
        if q.is_cuda and sdpa == "flash":
            params = torch.backends.cuda.SDPAParams(q, self.k_dense, self.v_dense, None, 0.0, False, True)
            if not torch.backends.cuda.can_use_flash_attention(params, debug=True):
                raise RuntimeError("the flash SDPA backend cannot run this shape; refusing to time another backend")
        return lambda: causal_attention(q, self.k_dense, self.v_dense, sdpa)

    def lists(self, c: int):
        """Slots of the sinks, the middle (selection candidates) and the local window plus the chunk."""
        a, t = self.args, self.page_table
        return t[: a.n_init], t[a.n_init: self.L - c - a.n_local], t[self.L - c - a.n_local:]

    def policy(self, kern, theta: float | None, fp8: bool = False) -> TokenSelect:
        """The engine's TokenSelect policy over this layer's keys (the fp8 copy for fp8 selection)."""
        a = self.args
        return TokenSelect(self.caches[fp8], kern, k=a.k, n_init=a.n_init, n_local=a.n_local, theta=theta)

    def step(self, kern, policy: TokenSelect, c: int, queries: list[torch.Tensor] | None = None):
        """fn() running one engine attention step for the last c tokens, as ``attention.attend`` does per
        sequence: the policy's list, sparse attention (bf16 K/V). queries: those of successive calls, in turn
        (default: the layer's)."""
        queries = queries or [self.q[c]]
        own = self.page_table[self.L - c:]
        step = start_step(policy, 0, self.page_table, self.L - c, c, c == 1, tuple(queries[0].shape),
                          queries[0].dtype)
        turns = itertools.cycle(queries)

        def run():
            q = next(turns)
            got = policy.attend(0, step, q, own)
            return kern.sparse_attention(q, self.k_pool, self.v_pool, got.slots, got.key_pos, got.q_pos,
                                         self.inv_freq, n_valid=got.n_valid)

        return run

    def attend(self, kern, q: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        """q [c, h, d] over the slot list, positions re-indexed 0..n-1 (the chunk at the end)."""
        n, c = slots.numel(), q.shape[0]
        pos = torch.arange(n, device=q.device)
        return kern.sparse_attention(q, self.k_pool, self.v_pool, slots, pos, pos[n - c:], self.inv_freq)

    def ours_chunk(self, kern, fp8: bool = False):
        return self.step(kern, self.policy(kern, theta=None, fp8=fp8), self.args.chunk)

    def ours_decode(self, kern, hit: bool, fp8: bool = False):
        """fn() of a decode step whose Selection-Cache check hits (the cache holds a query at cosine ~0.99)
        or misses (the query negated at every call: the same check, at cosine -1; every miss selects and stores),
        and its policy."""
        policy = self.policy(kern, theta=0.9, fp8=fp8)
        q = self.q[1]
        self.step(kern, policy, 1, [q + 0.1 * torch.randn_like(q)])()  # a miss: stores the previous step's query
        return self.step(kern, policy, 1, None if hit else [-q, q]), policy

    def parts(self, kern, fp8: bool = False) -> dict:
        """The chunk step's parts, timed alone: vote, top-k, sparse attention."""
        q = self.q[self.args.chunk]
        init, middle, recent = self.lists(q.shape[0])
        query = kern.query_mean(q, q.dtype)  # the chunk's selection query, as the policy computes it
        k_pool = self.caches[fp8].k_select[0]
        vote = kern.head_soft_vote(query, k_pool, middle, 1.0)
        slots = torch.cat([init, middle[kern.topk(vote, self.args.k)], recent])
        return {"vote": lambda: kern.head_soft_vote(query, k_pool, middle, 1.0),
                "topk": lambda: kern.topk(vote, self.args.k),
                "attention": lambda: self.attend(kern, q, slots)}

    def middle_key_bytes(self, fp8: bool = False) -> int:
        m = self.lists(self.args.chunk)[1].numel()
        return m * self.args.kv_heads * self.args.head_dim * (1 if fp8 else 2)

    def check_dense_equals_full_list(self, kern, sdpa: str = "flash") -> float:
        """Max |dense - sparse attention over every slot| for the chunk: both compute the same function,
        so this proves the dense baseline's mask, GQA and RoPE are the real ones."""
        c = self.args.chunk
        dense = self.dense(c, sdpa)()[0].transpose(0, 1)
        ours = self.attend(kern, self.q[c], self.page_table)
        return (dense.float() - ours.float()).abs().max().item()


def time_decode(layer: Layer, kern, ms, hit: bool, fp8: bool = False) -> float:
    """Milliseconds of a decode step that hits (or misses) the Selection Cache, checked to have done so."""
    fn, policy = layer.ours_decode(kern, hit, fp8)
    t = ms(fn)
    stats = policy.stats()
    hits, misses = stats.selection_cache_hits, stats.selection_cache_misses
    if not ((misses == 1 and hits > 0) if hit else hits == 0):
        raise RuntimeError(f"the decode {'hit' if hit else 'miss'} row saw {hits} hits and {misses} misses")
    return t


GRAPH_CALLS, GRAPH_REPLAYS = 4, 10


def graph_ms(fn) -> float:
    """Milliseconds a call of fn() takes captured in a CUDA graph (``graph_us``)."""
    return graph_us(lambda _: fn(), GRAPH_CALLS, GRAPH_REPLAYS) / 1e3


def dense_backends(layer: Layer, device: torch.device, row: dict) -> list[str]:
    """The SDPA backends dense runs by (``dense.causal_attention``): flash, and on CUDA cuDNN where it runs the
    chunk (its refusal is written to the row's ``sdpa_errors``), so that each dense figure is the faster one's."""
    if device.type != "cuda":
        return ["flash"]
    try:
        layer.dense(layer.args.chunk, "cudnn")()
        torch.cuda.synchronize()
    except RuntimeError as e:
        row["sdpa_errors"] = {"cudnn": str(e).splitlines()[0][:200]}
        return ["flash"]
    return ["flash", "cudnn"]


def graph_dense(layer: Layer, c: int, backends: list[str], row: dict) -> dict[str, float]:
    """Backend -> milliseconds of dense attention for c queries in a CUDA graph (``graph_ms``); a backend whose call
    cannot be captured is left out, its error written to the row's ``sdpa_errors`` (flash's is raised)."""
    times = {}
    for sdpa in backends:
        try:
            times[sdpa] = graph_ms(layer.dense(c, sdpa))
        except RuntimeError as e:
            if sdpa == "flash":
                raise
            row.setdefault("sdpa_errors", {})[f"{sdpa}, {c} queries, in a graph"] = str(e).splitlines()[0][:200]
    return times


def fastest(row: dict, key: str, by_sdpa: dict[str, float]) -> None:
    """row[key] = the fastest backend's time, row[key's stem + "_sdpa"] = its name, and every backend's time under
    row[key's stem + "_by_sdpa"]."""
    stem = key.removesuffix("_ms")
    row[key] = min(by_sdpa.values())
    row[f"{stem}_sdpa"] = min(by_sdpa, key=by_sdpa.get)
    row[f"{stem}_by_sdpa"] = by_sdpa


def measure(L: int, args, device: torch.device, ms, bandwidth: float, check: bool, kern) -> dict:
    """One KV length's row, ours by ``kern`` (``get_kernels`` with the run's chunk attention)."""
    layer = Layer(L, args, device)
    row = {"length": L}
    backends = dense_backends(layer, device, row)
    if check:
        for sdpa in backends:
            diff = row[f"max_abs_diff_dense_{sdpa}_vs_full_list"] = layer.check_dense_equals_full_list(kern, sdpa)
            if diff > 0.05:
                raise RuntimeError(f"dense SDPA ({sdpa}) and sparse attention over the full list differ by {diff}")
    fastest(row, "dense_chunk_ms", {sdpa: ms(layer.dense(args.chunk, sdpa)) for sdpa in backends})
    fastest(row, "dense_decode_ms", {sdpa: ms(layer.dense(1, sdpa)) for sdpa in backends})
    row["chunk_ms"] = ms(layer.ours_chunk(kern))
    row["miss_ms"] = time_decode(layer, kern, ms, hit=False)
    row["hit_ms"] = time_decode(layer, kern, ms, hit=True)
    row.update({f"chunk_{k}_ms": ms(fn) for k, fn in layer.parts(kern).items()})
    row["floor_ms"] = layer.middle_key_bytes() / bandwidth * 1e3
    if args.fp8_select:
        row["fp8_chunk_ms"] = ms(layer.ours_chunk(kern, fp8=True))
        row["fp8_miss_ms"] = time_decode(layer, kern, ms, hit=False, fp8=True)
        row["fp8_vote_ms"] = ms(layer.parts(kern, fp8=True)["vote"])
        row["fp8_floor_ms"] = layer.middle_key_bytes(fp8=True) / bandwidth * 1e3
    if device.type == "cuda":  # the steps captured in CUDA graphs: the GPU's time (a decode step runs so in the engine)
        fastest(row, "graph_dense_chunk_ms", graph_dense(layer, args.chunk, backends, row))
        row["graph_chunk_ms"] = graph_ms(layer.ours_chunk(kern))
        fastest(row, "graph_dense_decode_ms", graph_dense(layer, 1, backends, row))
        row["graph_miss_ms"] = time_decode(layer, kern, graph_ms, hit=False)
        row["graph_hit_ms"] = time_decode(layer, kern, graph_ms, hit=True)
        if args.fp8_select:
            row["graph_fp8_chunk_ms"] = graph_ms(layer.ours_chunk(kern, fp8=True))
            row["graph_fp8_miss_ms"] = time_decode(layer, kern, graph_ms, hit=False, fp8=True)
    del layer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def table(rows: list[dict], fp8: bool) -> str:
    """Markdown: milliseconds and ratios, every ratio from numbers of the same run."""
    head = ["KV", "dense chunk", "ours chunk", "chunk speedup", "vote / topk / attn",
            "dense decode", "miss", "miss / floor", "hit", "hit / dense", "read-K floor"]
    if fp8:
        head += ["fp8 chunk", "fp8 chunk speedup", "fp8 miss", "fp8 miss / bf16 floor"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [kv_label(r["length"]), dense_cell(r, "dense_chunk"), f"{r['chunk_ms']:.3f}",
                 f"{r['dense_chunk_ms'] / r['chunk_ms']:.1f}x",
                 f"{r['chunk_vote_ms']:.3f} / {r['chunk_topk_ms']:.3f} / {r['chunk_attention_ms']:.3f}",
                 dense_cell(r, "dense_decode"), f"{r['miss_ms']:.3f}", f"{r['miss_ms'] / r['floor_ms']:.2f}x",
                 f"{r['hit_ms']:.3f}", f"{r['hit_ms'] / r['dense_decode_ms']:.3f}x", f"{r['floor_ms']:.3f}"]
        if fp8:
            cells += [f"{r['fp8_chunk_ms']:.3f}", f"{r['dense_chunk_ms'] / r['fp8_chunk_ms']:.1f}x",
                      f"{r['fp8_miss_ms']:.3f}", f"{r['fp8_miss_ms'] / r['floor_ms']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def graph_table(rows: list[dict], fp8: bool) -> str:
    """Markdown: the steps captured in CUDA graphs (the GPU's time), their ratios, and the read-K floors."""
    head = ["KV", "dense chunk", "ours chunk", "chunk speedup", "ours / read-K floor", "dense decode", "miss",
            "miss / read-K floor", "hit", "hit / dense"]
    if fp8:
        head += ["fp8 chunk", "fp8 chunk speedup", "fp8 / fp8 read-K floor", "fp8 miss", "fp8 miss / fp8 floor"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        dense_decode = r["graph_dense_decode_ms"]
        cells = [kv_label(r["length"]), dense_cell(r, "graph_dense_chunk"), f"{r['graph_chunk_ms']:.3f}",
                 f"{r['graph_dense_chunk_ms'] / r['graph_chunk_ms']:.1f}x",
                 f"{r['graph_chunk_ms'] / r['floor_ms']:.2f}x", dense_cell(r, "graph_dense_decode"),
                 f"{r['graph_miss_ms']:.3f}",
                 f"{r['graph_miss_ms'] / r['floor_ms']:.2f}x", f"{r['graph_hit_ms']:.3f}",
                 f"{r['graph_hit_ms'] / dense_decode:.3f}x"]
        if fp8:
            cells += [f"{r['graph_fp8_chunk_ms']:.3f}", f"{r['graph_dense_chunk_ms'] / r['graph_fp8_chunk_ms']:.1f}x",
                      f"{r['graph_fp8_chunk_ms'] / r['fp8_floor_ms']:.2f}x", f"{r['graph_fp8_miss_ms']:.3f}",
                      f"{r['graph_fp8_miss_ms'] / r['fp8_floor_ms']:.2f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chunks_label(result: dict) -> str:
    """The title's note of how our chunks attended: ", chunks' attention by cudnn" (runs before the setting: the
    kernel's, unnamed)."""
    chunks = result.get("chunk_attention")
    return f", chunks' attention by {chunks}" if chunks and chunks != "triton" else ""


def dense_cell(row: dict, stem: str) -> str:
    """A dense time with its backend where several ran ("15.154 cudnn"); rows of runs before cuDNN was timed
    (no ``_sdpa`` key) ran flash alone."""
    sdpa = row.get(f"{stem}_sdpa")
    return f"{row[stem + '_ms']:.3f}" + (f" {sdpa}" if sdpa and len(row.get(f"{stem}_by_sdpa", {})) > 1 else "")


def backends_line(rows: list[dict]) -> str:
    """Each dense figure's backends, where several ran: every backend's time, so that the faster one is seen."""
    parts = []
    for r in rows:
        for stem in ("graph_dense_chunk", "graph_dense_decode", "dense_chunk", "dense_decode"):
            by = r.get(f"{stem}_by_sdpa", {})
            if len(by) > 1:
                times = ", ".join(f"{name} {t:.3f}" for name, t in by.items())
                parts.append(f"{kv_label(r['length'])} {stem.replace('_', ' ')}: {times}")
        if r.get("sdpa_errors"):
            parts.append(f"{kv_label(r['length'])}: not timed: {r['sdpa_errors']}")
    return ("Dense by each SDPA backend (ms; the table takes the faster): " + "; ".join(parts) + ".\n\n"
            if parts else "")


def kv_label(n: int) -> str:
    """A KV length as the tables write it: 32K, 1M (or the count itself)."""
    return f"{n >> 20}M" if n % (1 << 20) == 0 else f"{n >> 10}K" if n % 1024 == 0 else str(n)


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    if device.type == "cpu" and not args.tiny:
        raise SystemExit("bench attention times GPU kernels: run it on a CUDA device, or pass --device cpu --tiny "
                         "for a smoke test at tiny sizes")
    if args.tiny:
        args = argparse.Namespace(**{**vars(args), **TINY, "lengths": args.lengths or TINY["lengths"]})
    args.kernels = kernels_for(args.kernels, device)  # as the engine resolves its setting
    lengths = [parse_length(x) for x in (args.lengths or DEFAULT_LENGTHS).split(",")]
    ms = timer(device)
    bandwidth = copy_bandwidth(device, ms)
    # what runs a chunk's attention over its list, as the engine resolves its setting for these operands
    chunks = chunk_attention_backend(args.chunk_attention, args.kernels, device, torch.bfloat16)
    kern = get_kernels(args.kernels, chunks)
    rows = []
    for i, length in enumerate(lengths):
        rows.append(measure(length, args, device, ms, bandwidth, check=i == 0 and not args.no_check, kern=kern))
        print(json.dumps(rows[-1]), flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    meta = {k: v for k, v in vars(args).items() if k != "func"}
    result = {"device": name, "torch": torch.__version__, "copy_bandwidth_Bps": bandwidth, "args": meta,
              "chunk_attention": chunks, "rows": rows}
    report = render(result)
    print(report)
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"attention_{args.tag}" if args.tag else "attention"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1))
    (out / f"{stem}.md").write_text(report)
    return 0


def render(result: dict) -> str:
    """The markdown report of a run (``result``: what ``run`` writes as JSON). On CUDA the chunks' table in CUDA
    graphs comes first, the GPU's time; then every timing as launched from the host, one call at a time."""
    a, rows, fp8 = result["args"], result["rows"], result["args"]["fp8_select"]
    graphs = bool(rows) and "graph_chunk_ms" in rows[0]
    text = (f"# Attention, one layer: {a['heads']} q heads, {a['kv_heads']} kv heads, d={a['head_dim']}, bf16, "
            f"{a['kernels']} kernels{chunks_label(result)}, on {result['device']} (torch {result['torch']})"
            f"{', steps in CUDA graphs' if graphs else ''}\n\n"
            f"Chunk = {a['chunk']} queries; ours selects k={a['k']} with n_init={a['n_init']}, "
            f"n_local={a['n_local']}. Milliseconds; copy bandwidth {result['copy_bandwidth_Bps'] / 1e12:.2f} TB/s; "
            f"read-K floor = bytes of the middle's keys / copy bandwidth.\n\n")
    if graphs:
        text += (f"Captured in CUDA graphs ({GRAPH_CALLS} calls a graph): the GPU's time, without the host's "
                 f"launches; a decode step runs so in the engine.\n\n{graph_table(rows, fp8)}\n\n")
    return text + (f"Launched from the host one call at a time (medians; where a step's kernels are short, the "
                   f"host's launches set its time):\n\n{table(rows, fp8)}\n\n{backends_line(rows)}")


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "attention", help="one attention layer: dense SDPA against TokenSelect's kernels, per KV length",
        description="Time one Llama-3-8B-shaped attention layer: dense SDPA (flash and cuDNN) against TokenSelect "
                    "(prefill chunk, decode Selection-Cache miss and hit) and the read-K floor.")
    p.add_argument("--lengths", help=f"KV lengths (default {DEFAULT_LENGTHS}; with --tiny {TINY['lengths']})")
    p.add_argument("--kernels", choices=["triton", "torch"],
                   help="TokenSelect's kernels: triton, or the PyTorch references (default: triton on CUDA, the "
                        "references on a CPU)")
    p.add_argument("--chunk-attention", default="auto", choices=CHUNK_ATTENTION,
                   help="what runs our chunk's attention over its list, as the engine's --chunk-attention: auto "
                        "(cudnn on Hopper, as the engine), triton or cudnn")
    p.add_argument("--device", default=None, help="default: cuda if available")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (a CPU smoke test, not a benchmark)")
    p.add_argument("--heads", type=int, default=32, help="query heads (Llama-3-8B: 32)")
    p.add_argument("--kv-heads", type=int, default=8, help="key-value heads (Llama-3-8B: 8)")
    p.add_argument("--head-dim", type=int, default=128, help="dimensions a head")
    p.add_argument("--chunk", type=int, default=512, help="queries of the prefill chunk timed")
    p.add_argument("--k", type=int, default=2048, help="TokenSelect's k: tokens chosen from the middle")
    p.add_argument("--n-init", type=int, default=128, help="TokenSelect's sink tokens")
    p.add_argument("--n-local", type=int, default=512, help="TokenSelect's local window")
    p.add_argument("--fp8-select", action="store_true", help="also time selection over an fp8 copy of the keys")
    p.add_argument("--no-check", action="store_true", help="skip the dense == full-list correctness check")
    p.add_argument("--output", default="benchmarks/results", help="folder for the table and JSON")
    p.add_argument("--tag", default="", help="suffix for the output files, e.g. h100")
    p.set_defaults(func=run)

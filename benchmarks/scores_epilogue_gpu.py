"""What the scores kernel's softmax statistics cost in a decode step, and whether computing them on the real query rows
only pays, on a GPU.

    python benchmarks/scores_epilogue_gpu.py OUTDIR            # the variants below
    python benchmarks/scores_epilogue_gpu.py OUTDIR --tiles    # the shipped kernel at each of TILES

Why: compiled for sm_90 (``benchmarks/kernel_sass.py``), the kernel's loop over a block of 128 fp8 keys issued 614
instructions a thread with ``tl.exp`` in its statistics, of which 227 were the statistics' epilogue; without it, 387.
Over fp8 keys a thread issues that loop for half the bytes of bf16 keys, so where the kernel is bound by instruction
issue the epilogue is where fp8's 61% of the floor went (``results/supporting/e2e_128k_profile_h200.md``). The
epilogue runs on the product's 16 rows although a kv head has 4 query heads (Llama-3-8B): ``tl.dot`` needs 16.

Variants, each the shipped ``_scores_kernel``'s source with the lines named below changed (so they follow it):
- ``shipped``: as is (statistics on; their exponentials ``kernels/fast_exp.exp_ftz``);
- ``no stats``: ``STATS=False`` (what the statistics cost; the vote cannot use it);
- ``real rows``: the product's first ``next_power_of_2(G)`` rows are taken (``tl.split`` halvings) before the
  scale, the store and the statistics, so the epilogue runs on 4 rows, not 16;
- ``keys as A``: the keys as the product's first operand (scores^T = keys @ q^T: 128 rows, so Triton uses wgmma);
- ``plain exp``: the statistics' exponentials by ``tl.exp``, whose ``ex2.approx.f32`` takes four instructions an
  element where ``exp_ftz`` takes one (it keeps denormal results, which a sum of exponentials holding a 1 cannot
  show);
- ``real rows, plain exp``: both.

The table of the tree 157b2aa (``results/supporting/scores_epilogue_157b2aa_h200.md``) names the variants as they were
then: its ``shipped`` ran ``tl.exp``, its ``ftz exp`` is today's ``shipped``.

Each runs as a decode step runs it (``scores_with_stats``' launch: 32 query heads, 8 kv heads, d 128, the live length
read on the device) 32 times in one CUDA graph, one pool a layer (no layer's keys are in L2 for the next), at random
slots; the time is the median of 20 replays over 32. Each variant's scores and statistics are first checked against
the shipped kernel's. The floor reads the keys and the slots and writes the scores and statistics once at the copy
bandwidth measured here. Writes OUTDIR/scores_epilogue.{json,md} (with --tiles: OUTDIR/scores_tiles_graph.{json,md}).

``--tiles`` times the shipped kernel at other tiles the same way: ``scores_tile_gpu.py`` timed one launch at a time,
so at 128K its figures were the launch's (0.10 ms for every tile, 3x the kernel's time in a graph). A tile's
statistics have another column unit, so its check combines them into each head's max and sum first. What a tile
gains here need not show in a decode step: (128, 2, 4, 3) took the fp8 kernel from 51.6 to 49.0 us a layer at 128K
here, and the step from 8.23 to 8.22-8.23 ms in ``scores_tile_e2e.sh`` (``results/supporting/scores_tiles_graph_h200.md``).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import linecache
import textwrap
import types
from unittest import mock

import torch

# (benchmarks/: this script's folder)
from scores_tile_gpu import copy_bandwidth, save

paged_dot = importlib.import_module("tokenselect.kernels.paged_dot")  # the module (the package exports a function)
N_HEADS, N_KV, D, LAYERS = 32, 8, 128, 32

ROWS_HELPER = '''
@triton.jit
def first_rows(x, ROWS: tl.constexpr, KEEP: tl.constexpr):
    """The first KEEP rows of x [ROWS, C] (both powers of two), by halving the rows."""
    for _ in tl.static_range(ROWS.bit_length() - KEEP.bit_length()):
        x = tl.split(tl.permute(tl.reshape(x, [2, x.shape[0] // 2, x.shape[1]]), [1, 2, 0]))[0]
    return x

'''

# (old, new) line edits of the shipped kernel's source for each variant
KEYS_AS_A = [  # the keys as the product's first operand: scores^T [keys, query rows] = keys [keys, d] @ q^T
    ("k = tl.load(k_ptr + slots[None, :] * stride_slot + kvh * stride_kvh + dims[:, None],\n"
     "                        mask=dim_ok[:, None] & live[None, :], other=0.0)",
     "k = tl.load(k_ptr + slots[:, None] * stride_slot + kvh * stride_kvh + dims[None, :],\n"
     "                        mask=live[:, None] & dim_ok[None, :], other=0.0)"),
    ("s = mma(q, k.to(DOT_TY), IEEE) * scale", "s = tl.trans(mma(k.to(DOT_TY), q_t, IEEE)) * scale"),
    ("        for b in range(group_id * BLOCKS", "        q_t = tl.trans(q)\n        for b in range(group_id * BLOCKS"),
]
PLAIN_EXP = [("exp_ftz(s - tl.where(", "tl.exp(s - tl.where(")]
REAL_ROWS = [
    ("MASKED: tl.constexpr, FOLDED: tl.constexpr):", "MASKED: tl.constexpr, FOLDED: tl.constexpr, G_P: tl.constexpr):"),
    ("    heads = kvh * G + rows\n",
     "    heads = kvh * G + rows\n    rows_p = tl.arange(0, G_P)\n    heads_p, row_ok_p = kvh * G + rows_p, rows_p < G\n"),
    ("s = mma(q, k.to(DOT_TY), IEEE) * scale", "s = first_rows(mma(q, k.to(DOT_TY), IEEE), BLOCK_G, G_P) * scale"),
    ("tl.store(out_ptr + heads[:, None].to(tl.int64) * stride_out + cols[None, :], s,\n"
     "                     mask=row_ok[:, None] & col_ok[None, :])",
     "tl.store(out_ptr + heads_p[:, None].to(tl.int64) * stride_out + cols[None, :], s,\n"
     "                     mask=row_ok_p[:, None] & col_ok[None, :])"),
    ("tl.store(m_ptr + heads * n_blocks + b, m, mask=row_ok)", "tl.store(m_ptr + heads_p * n_blocks + b, m, mask=row_ok_p)"),
    ("tl.store(l_ptr + heads * n_blocks + b, l, mask=row_ok)", "tl.store(l_ptr + heads_p * n_blocks + b, l, mask=row_ok_p)"),
]


def edited_kernel(edits: list[tuple[str, str]]):
    """The shipped ``_scores_kernel`` with each ``old`` of edits replaced by its ``new`` (each must occur once), compiled
    in a module that holds the shipped module's names and ``first_rows``."""
    src = textwrap.dedent(inspect.getsource(paged_dot._scores_kernel.fn))
    for old, new in edits:
        if src.count(old) != 1:
            raise ValueError(f"the kernel's source no longer holds {old!r} once")
        src = src.replace(old, new)
    module = types.ModuleType("scores_epilogue_variant")
    module.__dict__.update(vars(paged_dot))
    module.__file__ = __file__ + f".variant{abs(hash(src))}.py"  # Triton keys its cache on the source itself
    text = ROWS_HELPER + "\n" + src
    # Triton's jit reads a kernel's source through inspect, which finds exec'd text only in linecache
    linecache.cache[module.__file__] = (len(text), None, text.splitlines(True), module.__file__)
    exec(compile(text, module.__file__, "exec"), module.__dict__)
    return module._scores_kernel


def swapped(name: str, value):
    """``paged_dot``'s global ``name`` is ``value`` inside the block (``scores_with_stats`` reads its kernel and its
    tile at each launch, so a graph captured inside records the swapped one)."""
    return mock.patch.object(paged_dot, name, value)


class WithConstants:
    """A jit kernel that ``scores_with_stats`` launches with more constexpr arguments (an edited kernel's own)."""

    def __init__(self, kernel, **constants):
        self.kernel, self.constants = kernel, constants

    def __getitem__(self, grid):
        launch = self.kernel[grid]
        return lambda *args, **kwargs: launch(*args, **kwargs, **self.constants)


def launcher(kernel, stats: bool, extra: dict):
    """A function (q, pool, slots, live) -> (scores, m, l): ``scores_with_stats`` as a decode step calls it, launching
    ``kernel`` (with the constexpr arguments ``extra``) in place of the shipped one."""
    runs = WithConstants(kernel, **extra) if extra else kernel

    def call(q, pool, slots, live):
        with swapped("_scores_kernel", runs):
            return paged_dot.scores_with_stats(q, pool, slots, 1.0, stats=stats, n_valid=live)
    return call


def graph_ms(fn, layers) -> float:
    """Median ms of one call of fn over a CUDA graph of one call a layer (each its own operands), 20 replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for args in layers:
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in layers:
            fn(*args)
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(layers))
    return sorted(times)[len(times) // 2]


# (keys per block, warps, blocks per program, pipeline stages); the first is the shipped SCORES_TILE
TILES = [paged_dot.SCORES_TILE, (128, 4, 4, 3), (128, 2, 4, 3), (64, 2, 4, 3), (64, 2, 8, 3), (64, 1, 8, 4),
         (32, 1, 8, 3), (128, 1, 4, 2), (256, 4, 4, 3)]


def at_tile(tile):
    """The shipped launch at another tile (SCORES_TILE is read at launch, so a graph captures the tile it ran)."""
    shipped = launcher(paged_dot._scores_kernel, True, {})

    def call(*args):
        with swapped("SCORES_TILE", tile):
            return shipped(*args)
    return call


def head_totals(m: torch.Tensor, l: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block (or per-anything) max and sum of exponentials [H, B] -> each head's max and sum [H]."""
    top = m.max(dim=1).values
    return top, (l * torch.exp(m - top[:, None])).sum(dim=1)


def main(out: str, mode: str = "") -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    bandwidth = copy_bandwidth(gen.device)
    tiles = mode == "--tiles"
    variants = {str(tuple(t)): at_tile(t) for t in TILES} if tiles else {"shipped": launcher(paged_dot._scores_kernel, True, {}),
                "no stats": launcher(paged_dot._scores_kernel, False, {}),
                "real rows": launcher(edited_kernel(REAL_ROWS), True, {"G_P": N_HEADS // N_KV}),
                "keys as A": launcher(edited_kernel(KEYS_AS_A), True, {}),
                "plain exp": launcher(edited_kernel(PLAIN_EXP), True, {}),
                "real rows, plain exp": launcher(edited_kernel(REAL_ROWS + PLAIN_EXP), True, {"G_P": N_HEADS // N_KV})}
    rows = []
    for name, n, layers_n in (("128K", 1 << 17, LAYERS), ("1M", 1 << 20, 8)):
        for dtype in (torch.float8_e4m3fn, torch.bfloat16):
            layers = []
            for _ in range(layers_n):
                q = torch.randn(N_HEADS, D, device="cuda", generator=gen).to(torch.bfloat16)
                pool = torch.randn(n + 1024, N_KV, D, device="cuda", generator=gen).to(dtype)
                slots = torch.randperm(n + 1024, device="cuda", generator=gen)[:n]
                layers.append((q, pool, slots, torch.tensor(n, device="cuda")))
            shipped_name = str(tuple(paged_dot.SCORES_TILE)) if tiles else "shipped"
            want = variants[shipped_name](*layers[0])
            n_blocks = want[1].shape[1]
            bytes_moved = n * (N_KV * D * dtype.itemsize + 8 + N_HEADS * 4) + 2 * N_HEADS * n_blocks * 4
            floor_ms = bytes_moved / bandwidth * 1e3
            for vname, fn in variants.items():
                got = fn(*layers[0])  # equal up to the order of a product's sums (the keys-as-A variants)
                if tiles:  # another block size: the statistics compared as each head's totals
                    got, want_here = (got[0], *head_totals(got[1], got[2])), (want[0], *head_totals(want[1], want[2]))
                else:
                    want_here = want
                for g, w in zip(got, want_here) if vname != "no stats" else zip(got[:1], want_here[:1]):
                    torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4)
                checked = torch.equal(got[0], want[0])
                ms = graph_ms(fn, layers)
                rows.append({"length": name, "keys": str(dtype).removeprefix("torch."), "variant": vname, "ms": ms,
                             "floor_ms": floor_ms, "scores_equal": checked, "shipped": shipped_name})
                print(json.dumps(rows[-1]), flush=True)
            del layers
            torch.cuda.empty_cache()
    lines = [f"# Scores kernel epilogue, {torch.cuda.get_device_name()} (copy bandwidth {bandwidth / 1e12:.2f} TB/s)",
             "", f"32 query heads, 8 kv heads, d 128, random slots; tile {tuple(paged_dot.SCORES_TILE)}; us a call, "
             "median of 20 replays of a CUDA graph of one call a layer.", "",
             f"| length | keys | {'tile' if tiles else 'variant'} | us | of floor | x shipped |", "|---|---|---|---|---|---|"]
    for r in rows:
        base = next(b for b in rows if (b["length"], b["keys"], b["variant"]) == (r["length"], r["keys"], r["shipped"]))
        lines.append(f"| {r['length']} | {r['keys']} | {r['variant']} | {r['ms'] * 1e3:.1f} | "
                     f"{r['floor_ms'] / r['ms']:.0%} | {base['ms'] / r['ms']:.2f} |")
    save(out, "scores_tiles_graph" if tiles else "scores_epilogue", bandwidth, rows, lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", metavar="OUTDIR", help="folder the results are written to (made if missing)")
    parser.add_argument("--tiles", action="store_true", help="time the shipped kernel at each of TILES instead")
    args = parser.parse_args()
    main(args.out, "--tiles" if args.tiles else "")

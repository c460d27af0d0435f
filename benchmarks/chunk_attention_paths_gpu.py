"""A prefill chunk's sparse attention both ways ``sparse_attention`` runs it (with a ``cudnn`` budget or without),
on the shapes a TokenSelect prefill runs, in CUDA graphs of 32 layers (``bench.attention.graph_us``), each checked
against ``sparse_attention_ref``:

- ``triton``: the sparse attention kernel over the list (its keys rotated once into a buffer);
- ``cudnn``: the list's keys rotated and its values gathered into buffers, the queries rotated, then PyTorch's cuDNN
  attention twice (the context unmasked, the chunk's own keys causal) merged by their log-sum-exps
  (``kernels.cudnn_attention``); and its parts, each in a graph of its own, with PyTorch's elementwise merge beside
  the merge kernel.

Shapes (Llama-3-8B: 32 query heads, 8 kv heads, d 128, bf16; lists of 128 sinks + 2,048 chosen + the 512-token
window + the group's own queries, slots drawn from a 128K pool, new lists each layer): ``groups``, a 2048-token chunk
as TokenSelect's default runs it (four groups of 512, each its own list), and ``chunk512``, one 512-token chunk.
Writes OUT/chunk_attention_paths.{json,md}.

    PYTHONPATH=$PWD python benchmarks/chunk_attention_paths_gpu.py OUT
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
from pathlib import Path

import torch
import triton

from tokenselect.bench.attention import graph_us
from tokenselect.kernels.cudnn_attention import PlanBudget, cudnn_attention, merge_by_lse, merge_by_lse_ref

attention = importlib.import_module("tokenselect.kernels.sparse_attention")

HEADS, KV, D, POOL, LAYERS = 32, 8, 128, 131072, 32
CONTEXT = 128 + 2048 + 512
SHAPES = {"groups": (4, 512), "chunk512": (1, 512)}


def lists(gen: torch.Generator, groups: int, queries: int, device: torch.device) -> torch.Tensor:
    """One layer's [groups, CONTEXT + queries] slot lists, each group's own queries' slots last."""
    own = torch.arange(POOL - queries * groups, POOL).view(groups, queries)
    return torch.stack([torch.cat([torch.randperm(POOL - queries * groups, generator=gen)[:CONTEXT], own[g]])
                        for g in range(groups)]).to(device)


def operands(gen: torch.Generator, groups: int, queries: int, device: torch.device) -> list[dict]:
    """Every layer's call: the queries, the pools, the lists and positions (re-indexed: 0 .. n-1)."""
    n = CONTEXT + queries
    positions = torch.arange(n, device=device)
    first = dict(q=torch.randn(groups, queries, HEADS, D, generator=gen).to(device, torch.bfloat16),
                 k_pool=torch.randn(POOL, KV, D, generator=gen).to(device, torch.bfloat16),
                 v_pool=torch.randn(POOL, KV, D, generator=gen).to(device, torch.bfloat16),
                 slots=lists(gen, groups, queries, device), key_pos=positions,
                 q_pos=positions[-queries:].expand(groups, queries),
                 inv_freq=1.0 / (500000.0 ** (torch.arange(0, D, 2, device=device).float() / D)))
    return [first] + [{**first, "slots": lists(gen, groups, queries, device)} for _ in range(LAYERS - 1)]


class CudnnParts:
    """The cuDNN path's parts for one layer's operands (as ``sparse_attention._chunk_by_cudnn`` runs them), each
    callable alone."""

    def __init__(self, ops: dict):
        self.ops = ops
        batch, c = ops["q"].shape[:2]
        self.c, self.n = c, ops["slots"].shape[1]

    def prepare(self):
        """Keys rotated and values gathered in one pass, queries rotated (``sparse_attention.cudnn_operands``):
        [B, *, heads, d] seen as [B, heads, *, d]."""
        o = self.ops
        queries, keys, values = attention.cudnn_operands(o["q"], o["k_pool"], o["v_pool"], o["slots"], o["key_pos"],
                                                         o["q_pos"], o["inv_freq"])
        return queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)

    def context(self, q, k, v):
        return cudnn_attention(q, k[:, :, :self.n - self.c], v[:, :, :self.n - self.c], False)

    def own(self, q, k, v):
        return cudnn_attention(q, k[:, :, self.n - self.c:], v[:, :, self.n - self.c:], True)

    @staticmethod
    def merge(a, b):
        """The two parts' (out [B, H, c, d], lse) merged into [B, c, H, d] rows."""
        batch, heads, c, d = a[0].shape
        out = torch.empty(batch, c, heads, d, dtype=a[0].dtype, device=a[0].device)
        merge_by_lse(*a, *b, out=out.transpose(1, 2))
        return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--replays", type=int, default=10)
    args = p.parse_args()
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    rows = []
    for shape, (groups, queries) in SHAPES.items():
        layers = operands(gen, groups, queries, device)
        n = CONTEXT + queries
        flops = 4 * groups * queries * HEADS * D * (CONTEXT + (queries + 1) / 2)
        want = attention.sparse_attention_ref(**layers[0]).float()
        for backend in ("triton", "cudnn"):
            call = functools.partial(attention.sparse_attention, cudnn=PlanBudget() if backend == "cudnn" else None)
            got = call(**layers[0]).float()
            us = graph_us(lambda i: call(**layers[i]), LAYERS, args.replays)
            rows.append({"shape": shape, "path": backend, "us_per_layer": us, "tflops": flops / us / 1e6,
                         "max_diff": (got - want).abs().max().item()})
            print(rows[-1], flush=True)
        cudnn = [CudnnParts(ops) for ops in layers]
        try:  # the cuDNN path's parts, each alone
            prepared = [c.prepare() for c in cudnn]
            ctx = [c.context(*x) for c, x in zip(cudnn, prepared)]
            own = [c.own(*x) for c, x in zip(cudnn, prepared)]
            parts = {"rotate keys and queries, gather values": lambda i: cudnn[i].prepare(),
                     "cuDNN over the context": lambda i: cudnn[i].context(*prepared[i]),
                     "cuDNN over the own keys (causal)": lambda i: cudnn[i].own(*prepared[i]),
                     "merge (Triton)": lambda i: cudnn[i].merge(ctx[i], own[i]),
                     "merge (PyTorch)": lambda i: merge_by_lse_ref(*ctx[i], *own[i])}
            for name, call in parts.items():
                rows.append({"shape": shape, "path": f"part: {name}", "us_per_layer": graph_us(call, LAYERS,
                                                                                              args.replays)})
                print(rows[-1], flush=True)
        except Exception as err:  # noqa: BLE001
            rows.append({"shape": shape, "path": "parts", "error": f"{type(err).__name__}: {str(err)[:300]}"})
        print(f"{shape}: lists of {n}", flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
            "cudnn": torch.backends.cudnn.version()}
    (out / "chunk_attention_paths.json").write_text(json.dumps({**meta, "rows": rows}, indent=1))
    lines = [f"# A prefill chunk's sparse attention both ways, {HEADS}/{KV} heads, d {D}, bf16, {LAYERS} layers in "
             f"one CUDA graph, on {torch.cuda.get_device_name()}", "",
             "groups: 4 groups x 512 queries, lists of 3,200; chunk512: 1 x 512, lists of 3,200", "",
             "| shape | path | us a layer | TFLOP/s | max diff from the reference |", "|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['path']} | {r['error']} | | |")
        else:
            tf = f"{r['tflops']:.0f}" if "tflops" in r else ""
            diff = f"{r['max_diff']:.1e}" if "max_diff" in r else ""
            lines.append(f"| {r['shape']} | {r['path']} | {r['us_per_layer']:.1f} | {tf} | {diff} |")
    (out / "chunk_attention_paths.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

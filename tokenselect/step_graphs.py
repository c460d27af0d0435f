"""Engine steps as CUDA graphs, captured piecewise around attention.

With sparse attention at long contexts, a step's time is set as much by the host launching a few
dozen small kernels per layer as by the GPU's work. Everything between two attention calls (the
previous layer's output projection and MLP, this layer's norm and q/k/v projections) works row by
row and depends only on the number of rows, so it is captured once per size as one CUDA graph.
Attention runs eagerly between the graphs: what it attends (the policy's plan, the Selection
Cache's decision) changes from step to step.

For a model of L layers the pieces are:
    piece 0:          ids -> x, q, k, v of layer 0         (embedding, layer 0's norm and projections)
    piece i, 0<i<L:   x, out -> x, q, k, v of layer i      (layer i-1's o_proj and MLP, then layer i's)
    piece L:          x, out -> x                          (the last layer's o_proj and MLP)
where ``out`` is the previous attention's result, copied into a static buffer. The final norm and
the vocabulary projection run eagerly on the rows that need logits. A step of n tokens (decode tokens
of several sequences, a prefill chunk, or both) runs in the smallest size >= n: the decode buckets
1, 2, 4, ..., 64 and the prefill chunk size. The padding rows compute on token 0 and are never
attended or read. Without CUDA (or with ``capture=False``) the same pieces run eagerly over the same
buffers, which is how the tests exercise the plumbing on a CPU.
"""

from __future__ import annotations

from typing import Callable

import torch

from .cuda_graphs import GraphPool, capture, warm_up
from .models.llama import AttentionContext, CausalLM

DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class StepGraphs:
    """``run(ids, ctx)``: the model's layers over a step's tokens, through the pieces above."""

    def __init__(self, model: CausalLM, device: torch.device, chunk_size: int = 0, capture: bool | None = None):
        """chunk_size: the prefill chunk, captured as a size of its own; capture: record CUDA graphs
        (default: when ``device`` is a GPU)."""
        self.model, self.device = model, device
        self.sizes = tuple(sorted(set(DECODE_BUCKETS) | ({chunk_size} if chunk_size else set())))
        self.capture = device.type == "cuda" if capture is None else capture
        self.pool = GraphPool() if self.capture else None
        self._buckets: dict[int, _Bucket] = {}

    def bucket(self, n: int) -> int | None:
        """The size a step of ``n`` tokens runs in; None if larger than the largest."""
        return next((size for size in self.sizes if size >= n), None)

    def run(self, ids: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """ids: [n] -> the last layer's output [n, hidden] (a view of a static buffer, valid until the next
        run of this size). ``ctx.attention(layer, q, k, v)`` gets the n real rows."""
        n = ids.numel()
        size = self.bucket(n)
        if size is None:
            raise ValueError(f"a step of {n} tokens exceeds the largest captured size ({self.sizes[-1]})")
        bucket = self._buckets.get(size) or self._build(size)
        bucket.ids[:n].copy_(ids)
        bucket.ids[n:].zero_()
        for i, layer in enumerate(self.model.model.layers):
            _, q, k, v = bucket.play(i)
            bucket.attn_out[:n].copy_(ctx.attention(layer.self_attn.layer, q[:n], k[:n], v[:n]))
        return bucket.play(len(self.model.model.layers))[:n]

    def _build(self, size: int) -> "_Bucket":
        cfg, p = self.model.config, next(self.model.parameters())
        ids = torch.zeros(size, dtype=torch.int64, device=self.device)
        attn_out = torch.zeros(size, cfg.n_heads, cfg.head_dim, dtype=p.dtype, device=self.device)
        layers, embed = self.model.model.layers, self.model.model.embed_tokens

        def first(_):
            x = embed(ids)
            return (x, *layers[0].attention_inputs(x))

        def between(i: int) -> Callable:
            def piece(prev):
                x = layers[i - 1].finish(prev[0], attn_out)
                return (x, *layers[i].attention_inputs(x))
            return piece

        def last(prev):
            return layers[-1].finish(prev[0], attn_out)

        bucket = _Bucket(ids, attn_out, [first] + [between(i) for i in range(1, len(layers))] + [last])
        if self.capture:
            bucket.capture(self.pool)
        self._buckets[size] = bucket
        return bucket


class _Bucket:
    """The static buffers and pieces of one size; ``play(i)`` runs piece i and returns its outputs."""

    def __init__(self, ids: torch.Tensor, attn_out: torch.Tensor, pieces: list[Callable]):
        self.ids, self.attn_out, self.pieces = ids, attn_out, pieces
        self.outputs: list = [None] * len(pieces)
        self.graphs: list[torch.cuda.CUDAGraph] | None = None

    def play(self, i: int):
        if self.graphs is None:
            self.outputs[i] = self.pieces[i](self.outputs[i - 1] if i else None)
        else:
            self.graphs[i].replay()
        return self.outputs[i]

    def capture(self, pool: GraphPool) -> None:
        """Run every piece once (``warm_up``), then record each into its own graph; the outputs recorded are
        the static tensors each replay rewrites."""
        warm_up(lambda: [self.play(i) for i in range(len(self.pieces))])
        graphs = []
        for i, piece in enumerate(self.pieces):
            graph, self.outputs[i] = capture(lambda: piece(self.outputs[i - 1] if i else None), pool)
            graphs.append(graph)
        self.graphs = graphs

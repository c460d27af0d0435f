"""ReAttention: position-agnostic top-k before ordinary RoPE attention (Liu et al., 2024).

Every (chunk query, head) pair picks its ``top`` best middle tokens by un-rotated dot product;
the picks are pooled as votes, the ``n_spans`` most-voted tokens win, and each winner is widened
to a span of ``span`` neighbours (overlaps merged). The attended list [global, spans, local] is
then placed at contiguous positions, so the model's window is never exceeded: the number of spans
is capped so that global + spans + local + chunk fits in ``window``.
Defaults follow the paper: global 32, local 4096, span 32, 127 spans.
"""

from __future__ import annotations

import torch

from ..kernels import Kernels
from ..kv_cache import KVCache
from .base import SelectivePolicy, SeqView

SCORE_ELEMENTS = 1 << 24  # scores computed per block of chunk queries, at most this many floats


class ReAttention(SelectivePolicy):
    name = "reattention"

    def __init__(self, cache: KVCache, kernels: Kernels, window: int, n_init: int = 32, n_local: int = 4096,
                 span: int = 32, n_spans: int = 127, top: int = 1, chunk: int = 512, positions: str = "reindex"):
        room = window - n_init - n_local - chunk
        if room < 0:
            raise ValueError(f"reattention: n_init {n_init} + n_local {n_local} + chunk {chunk} exceed the "
                             f"model window {window}; lower n_local")
        n_spans = min(n_spans, room // max(span, 1))
        super().__init__(cache, kernels, n_init=n_init, n_local=n_local, budget=n_spans * span, positions=positions)
        self.span, self.n_spans, self.top = span, n_spans, top

    def select(self, layer: int, seq: SeqView, q: torch.Tensor, middle: torch.Tensor) -> torch.Tensor:
        if self.n_spans == 0:
            return torch.empty(0, dtype=torch.int64, device=middle.device)
        k_pool = self.cache.k_select[layer]
        n_heads, m = q.shape[1], middle.numel()
        block = max(1, SCORE_ELEMENTS // (n_heads * m))
        picks = []
        for start in range(0, q.shape[0], block):
            part = q[start:start + block]  # [b, n_heads, d], in its own dtype (an fp8 pool's keys are upcast)
            # head-major rows: row h*b + i is head h, so the GQA mapping row -> kv head stays h // group
            rows = part.transpose(0, 1).reshape(n_heads * part.shape[0], -1)
            scores = self.kernels.paged_dot(rows, k_pool, middle)  # [n_heads * b, M]
            picks.append(torch.topk(scores, min(self.top, m), dim=1).indices.flatten())
        winners, votes = torch.unique(torch.cat(picks), return_counts=True)
        if winners.numel() > self.n_spans:
            winners = winners[torch.topk(votes, self.n_spans).indices]
        offsets = torch.arange(-(self.span // 2), (self.span + 1) // 2, device=winners.device)
        spans = (winners[:, None] + offsets[None, :]).flatten().clamp(0, m - 1)
        return torch.unique(spans)  # sorted

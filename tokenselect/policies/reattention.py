"""ReAttention: position-agnostic top-k before ordinary RoPE attention (Liu et al., 2024).

Every (chunk query, head) pair picks its ``top`` best middle tokens by un-rotated dot product (the
default, one, in a kernel pass that never writes the scores: ``paged_argmax``); the picks are pooled
as votes, the ``n_spans`` most-voted tokens win, and each winner is widened to a span of ``span``
neighbours (overlaps merged). The attended list [global, spans, local] is
then placed at contiguous positions, so the model's window is never exceeded: the number of spans
is capped so that global + spans + local + chunk fits in ``window``.
Defaults follow the paper: global 32, local 4096, span 32, 127 spans.

All of it runs on the device with shapes fixed by the step (the middle's span of the table, the budget
of n_spans * span tokens), so nothing is read back on the host: the votes are counted by a scatter, the
spans are marked on the middle by a difference array, and the marked tokens, fewer than the budget where
spans overlap or touch an edge, are packed to the front of the choice (``SelectivePolicy.assemble`` closes
up the rest).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import Kernels
from ..kv_cache import KVCache
from ..settings import Validated, setting
from .base import SelectivePolicy, SeqStep, dense_until_setting, n_init_setting, n_local_setting, positions_setting

SCORE_ELEMENTS = 1 << 24  # scores computed per block of chunk queries, at most this many floats


@dataclass(frozen=True)
class ReAttentionSettings(Validated):
    n_init: int = n_init_setting(32)
    n_local: int = n_local_setting(4096)
    span: int = setting(32, "neighbours attended around each selected token", unit="tokens", low=1, scales=True)
    n_spans: int = setting(127, "selected spans (k'); at most what fits the window beside n_init + n_local + chunk",
                           low=0)
    top: int = setting(1, "best middle tokens each (chunk query, head) pair votes for", low=1)
    positions: str = positions_setting()
    dense_until: int | None = dense_until_setting()


class ReAttention(SelectivePolicy):
    name = "reattention"
    Settings = ReAttentionSettings

    def __init__(self, cache: KVCache, kernels: Kernels, window: int, chunk: int = 512, **settings):
        """window: the model's; chunk: the engine's prefill chunk (the list must fit the window beside it)."""
        s = self.Settings(**settings)
        room = window - s.n_init - s.n_local - chunk
        if room < 0:
            raise ValueError(f"reattention: n_init {s.n_init} + n_local {s.n_local} + chunk {chunk} exceed the "
                             f"model window {window}; lower n_local")
        n_spans = min(s.n_spans, room // s.span)
        super().__init__(cache, kernels, n_init=s.n_init, n_local=s.n_local, budget=n_spans * s.span,
                         positions=s.positions, dense_until=s.dense_until)
        self.span, self.n_spans, self.top = s.span, n_spans, s.top

    def choose(self, layer: int, step: SeqStep, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        middle, live = self.middle(step)
        m, dev = middle.numel(), middle.device
        if self.n_spans == 0 or m == 0:
            return middle.new_zeros(0), live.new_zeros(())
        dead = step.once(f"reattention dead {m}", lambda: self.cache.arange(m) >= live)
        k_pool = self.cache.k_select[layer]
        n_heads = q.shape[1]
        votes = torch.zeros(m, device=dev)  # counts, exact in fp32: a token gets at most one vote a (query, head) pair
        # head-major rows: row h*b + i is head h, so the GQA mapping row -> kv head stays h // group (q: in its own
        # dtype; an fp8 pool's keys are upcast); with top 1 every query at once, else a block of queries at a time
        block = q.shape[0] if self.top == 1 else max(1, SCORE_ELEMENTS // (n_heads * m))
        for start in range(0, q.shape[0], block):
            part = q[start:start + block]  # [b, n_heads, d]
            rows = part.transpose(0, 1).reshape(n_heads * part.shape[0], -1)
            if self.top == 1:  # each row's best key in one pass: the scores are never written
                picks = self.kernels.paged_argmax(rows, k_pool, middle, live)
            else:  # the block's scores, and their top picks
                scores = self.kernels.paged_dot(rows, k_pool, middle).masked_fill_(dead, float("-inf"))  # [rows, M]
                picks = torch.topk(scores, min(self.top, m), dim=1).indices.flatten()
            votes.scatter_add_(0, picks, torch.ones(picks.numel(), dtype=votes.dtype, device=dev))
        self.heads.sum(votes)  # every rank's heads' votes (``parallel.HeadReduce``)
        # the n_spans most-voted tokens among those with a vote, of equal votes the earliest (so that the choice
        # does not depend on the table's padding): the kernels' top-k takes the first of scores tied at the k-th
        winners = self.kernels.topk(votes, self.n_spans)
        won = votes.index_select(0, winners) > 0
        # each winner covers [w - span // 2, w + (span + 1) // 2), clipped to the live middle: +1 where a span
        # starts, -1 past its end, and a running sum marks the covered tokens
        edges = torch.zeros(m + 1, device=dev)
        lo = (winners - self.span // 2).clamp(min=0)
        hi = (winners + (self.span + 1) // 2).clamp(max=m)
        edges.scatter_add_(0, lo, won.float()).scatter_add_(0, hi, -won.float())
        covered = (edges[:m].cumsum(0) > 0) & ~dead
        # pack the covered tokens' indices, in order, to the front of a [budget] choice (the rest: a dump entry)
        rank = covered.cumsum(0) - 1
        chosen = middle.new_zeros(self.budget + 1)
        chosen.scatter_(0, torch.where(covered, rank, self.budget), self.cache.arange(m))
        return chosen[:self.budget], covered.sum()

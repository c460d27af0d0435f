"""QUEST: query-aware page selection by per-page key bounds (Tang et al., 2024, "Quest:
Query-Aware Sparsity for Efficient Long-Context LLM Inference").

The middle of the cache is cut into pages of ``page_size`` tokens, aligned to its start (the last
page may be partial). A page is summarised by the channel-wise minimum and maximum of its keys, per
kv head. For the selection query q (the chunk's mean query; the token's own query in decode) the
page's upper bound on q_h . k for query head h, reading kv head kv(h), is

    u[h, p] = sum_c max(q[h, c] * min[p, kv(h), c], q[h, c] * max[p, kv(h), c])     (``kernels.page_scores``)

QUEST selects pages per head. Our list is shared by all heads, so pages are ranked by
max_h u[h, p]: a page is in the running as soon as one head's bound is high, which is the union of
QUEST's per-head choices. A sum over heads would let pages that many heads find moderately useful
crowd out the page a single retrieval head needs. The ``k // page_size`` best pages are attended.

The bounds of full pages are computed before a step (``prepare``, outside any CUDA graph), once per page, and
kept in a row per sequence; a selection then reads two vectors per page, plus the keys of the partial last page,
all on the device, so a step records as a CUDA graph (``SelectivePolicy.graph_ready``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import Kernels
from ..kv_cache import KVCache
from ..settings import Validated, setting
from .base import (SELECT, SelectivePolicy, SeqStep, dense_until_setting, n_init_setting, n_local_setting,
                   positions_setting)
from .rows import Rows, grown


@dataclass(frozen=True)
class QuestSettings(Validated):
    k: int = setting(4096, "tokens selected from the middle of the cache, in whole pages", unit="tokens", low=0,
                     scales=True, per_request=True)
    page_size: int = setting(16, "tokens per page", unit="tokens", low=1)
    n_init: int = n_init_setting(0)
    n_local: int = n_local_setting(16)
    positions: str = positions_setting()
    dense_until: int | None = dense_until_setting()


class Quest(SelectivePolicy):
    name = "quest"
    Settings = QuestSettings

    def __init__(self, cache: KVCache, kernels: Kernels, **settings):
        s = self.Settings(**settings)
        super().__init__(cache, kernels, n_init=s.n_init, n_local=s.n_local, budget=s.k, positions=s.positions,
                         dense_until=s.dense_until)
        self.k, self.page_size = s.k, s.page_size
        self.rows = Rows()
        self.pages: dict[int, int] = {}  # sequence id -> its full pages with bounds
        _, _, n_kv, d = cache.k.shape
        # [rows, layers, pages, n_kv, d] fp32: each page's channel-wise key minimum and maximum
        self.lo = torch.zeros(0, cache.k.shape[0], 1, n_kv, d, device=cache.k.device)
        self.hi = self.lo.clone()

    def prepare(self, seq_id: int, slots: torch.Tensor, t: int, capacity: int, decode: bool,
                q_shape: tuple[int, int, int], q_dtype: torch.dtype) -> int:
        """Bounds for the full pages of the middle a selecting step sees (and room for its partial last one)."""
        row = self.rows.take(seq_id)
        if row >= self.lo.shape[0]:
            # no spare rows up front: a row's bounds are a quarter of its bf16 keys' bytes at pages of 16 (2 GB at 128K
            # tokens of a Llama-3-8B shape, twice that with the page axis' spare capacity)
            self.lo, self.hi = (grown(b, 0, 2 * row + 1) for b in (self.lo, self.hi))
        if self.mode(t, q_shape[0]) != SELECT:
            return row
        ps, have = self.page_size, self.pages.get(seq_id, 0)
        full = (t - self.n_init - self.n_local) // ps
        if full + 1 > self.lo.shape[2]:
            self.lo, self.hi = (grown(b, 2, 2 * (full + 1)) for b in (self.lo, self.hi))
        if full > have:  # pages filled since the last selection (``cache.k[layer]``: the one read a policy has of
            # every layer's keys, the transformers backend's cache too)
            tokens = slots[self.n_init + have * ps:self.n_init + full * ps]
            for layer in range(self.lo.shape[1]):
                keys = self.cache.k[layer][tokens].float().unflatten(0, (-1, ps))  # [pages, ps, n_kv, d]
                self.lo[row, layer, have:full] = keys.amin(dim=1)
                self.hi[row, layer, have:full] = keys.amax(dim=1)
        self.pages[seq_id] = full
        return row

    def choose(self, layer: int, step: SeqStep, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        middle, live = self.middle(step)
        ps, m = self.page_size, middle.numel()
        n_full = live // ps
        # the partial last page's bounds, from its live keys: the page after the full ones
        tail = n_full * ps + self.cache.arange(ps)
        live_tail = (tail < live)[:, None, None]
        keys = self.cache.k[layer][middle.index_select(0, tail.clamp(max=m - 1))].float()  # [ps, n_kv, d]
        tail_lo = keys.masked_fill(~live_tail, float("inf")).amin(dim=0)
        tail_hi = keys.masked_fill(~live_tail, float("-inf")).amax(dim=0)
        n_pages = (live + ps - 1) // ps  # the live ones: the kernel reads no bound of the row's spare capacity
        scores = self.kernels.page_scores(self.kernels.query_mean(q), self.lo[:, layer], self.hi[:, layer], step.row,
                                          tail_lo, tail_hi, n_full, n_pages)
        scores = self.heads.max(scores)  # the best head of every rank
        pages = self.kernels.topk(scores, self.k // ps, n_pages)
        tokens = (pages[:, None] * ps + self.cache.arange(ps)[None, :]).flatten()
        # ascending: the live tokens first (the partial page's dead end and pages past the live ones after them)
        return tokens.clamp(max=m - 1), (tokens < live).sum()

    def graph_reads(self) -> tuple[torch.Tensor, ...]:
        """The bounds a step reads: ``prepare`` fills new pages in place before a step, and when the page axis
        grows the tensors are new ones, for which a graph is recorded again."""
        return self.lo, self.hi

    def release(self, seq_id: int) -> None:
        self.rows.release(seq_id)
        self.pages.pop(seq_id, None)

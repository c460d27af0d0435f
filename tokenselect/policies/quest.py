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

The bounds (``pages.PageBounds``) are kept per sequence and extended before a step, so a step records as a CUDA
graph (``SelectivePolicy.graph_ready``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import Kernels
from ..kv_cache import KVCache
from ..settings import Validated, setting
from .base import (SELECT, SelectivePolicy, SeqStep, dense_until_setting, n_init_setting, n_local_setting,
                   positions_setting, selection_query)
from .pages import PageBounds, page_size_setting
from .rows import Rows


@dataclass(frozen=True)
class QuestSettings(Validated):
    k: int = setting(4096, "tokens selected from the middle of the cache, in whole pages", unit="tokens", low=0,
                     scales=True, per_request=True)
    page_size: int = page_size_setting()
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
        self.bounds = PageBounds(cache, kernels, s.page_size, s.n_init)

    def prepare(self, seq_id: int, slots: torch.Tensor, t: int, capacity: int, decode: bool,
                q_shape: tuple[int, int, int], q_dtype: torch.dtype) -> int:
        """Bounds for the full pages of the middle a selecting step sees (and room for its partial last one)."""
        row = self.rows.take(seq_id)
        if self.mode(t, q_shape[0]) == SELECT:
            self.bounds.update(seq_id, row, slots, t - self.n_init - self.n_local)
        return row

    def choose(self, layer: int, step: SeqStep, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        middle, live = self.middle(step)
        ps, m = self.page_size, middle.numel()
        scores, n_pages = self.bounds.scores(layer, step.row, selection_query(q), middle, live)
        pages = self.kernels.topk(self.heads.max(scores), self.k // ps, n_pages)  # the best head of every rank
        tokens = (pages[:, None] * ps + self.cache.arange(ps)[None, :]).flatten()
        # ascending: the live tokens first (the partial page's dead end and pages past the live ones after them)
        return tokens.clamp(max=m - 1), (tokens < live).sum()

    def graph_reads(self) -> tuple[torch.Tensor, ...]:
        return self.bounds.tensors()

    def release(self, seq_id: int) -> None:
        self.rows.release(seq_id)
        self.bounds.release(seq_id)

"""Page bounds: the channel-wise minimum and maximum of the keys of each page of a sequence's middle.

QUEST ranks pages by the upper bound they give on q . k (``kernels.page_scores``); TokenSelect's two-stage
selection (``candidates``) uses the same ranking to shortlist the pages whose tokens it then votes on. The
middle is cut into pages of ``page_size`` tokens aligned to its start (the last page may be partial).

The bounds of full pages are computed before a step (``update``, from a policy's ``prepare``: outside any CUDA
graph), once per page, and kept in a row per sequence (the policy's row); a step's ``scores`` read two vectors a
page, plus the keys of the partial last page, all on the device, so a step records as a CUDA graph.
"""

from __future__ import annotations

import torch

from ..kernels import Kernels
from ..kv_cache import KVCache
from ..settings import setting
from .rows import grown


def page_size_setting():
    return setting(16, "tokens per page: the unit QUEST selects, and TokenSelect's shortlist with candidates > 0",
                   unit="tokens", low=1)


class PageBounds:
    def __init__(self, cache: KVCache, kernels: Kernels, page_size: int, first: int):
        """first: the table index of the middle's first token (the policy's n_init)."""
        self.cache, self.kernels, self.page_size, self.first = cache, kernels, page_size, first
        self.pages: dict[int, int] = {}  # sequence id -> its full pages with bounds
        n_layers, _, n_kv, d = cache.k.shape
        # [rows, layers, pages, n_kv, d] fp32: each page's channel-wise key minimum and maximum
        self.lo = torch.zeros(0, n_layers, 1, n_kv, d, device=cache.k.device)
        self.hi = self.lo.clone()

    def update(self, seq_id: int, row: int, slots: torch.Tensor, middle_tokens: int) -> None:
        """Bounds for the full pages among the first ``middle_tokens`` of the middle (``slots``: the sequence's
        slot table), in ``row``, and room for the partial page after them. Pages already bounded are kept."""
        if row >= self.lo.shape[0]:
            self.lo, self.hi = (grown(b, 0, max(4, 2 * row)) for b in (self.lo, self.hi))
        ps, have = self.page_size, self.pages.get(seq_id, 0)
        full = middle_tokens // ps
        if full + 1 > self.lo.shape[2]:
            self.lo, self.hi = (grown(b, 2, 2 * (full + 1)) for b in (self.lo, self.hi))
        if full > have:  # pages filled since the last selection (``cache.k[layer]``: the one read a policy has of
            # every layer's keys, the transformers backend's cache too)
            tokens = slots[self.first + have * ps:self.first + full * ps]
            for layer in range(self.lo.shape[1]):
                keys = self.cache.k[layer][tokens].float().unflatten(0, (-1, ps))  # [pages, ps, n_kv, d]
                self.lo[row, layer, have:full] = keys.amin(dim=1)
                self.hi[row, layer, have:full] = keys.amax(dim=1)
        self.pages[seq_id] = full

    def scores(self, layer: int, row: torch.Tensor, query: torch.Tensor, middle: torch.Tensor,
               live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(The best head's bound on query . k for every page of the row's capacity [P] fp32, -inf past the live
        ones; the live pages, int64 []). query: [n_heads, d]; middle: [M] slots; live: int64 [], the middle's
        live tokens (0: no page is read). The partial last page's bounds come from its live keys."""
        ps, m = self.page_size, middle.numel()
        n_full = live // ps
        tail = n_full * ps + self.cache.arange(ps)
        live_tail = (tail < live)[:, None, None]
        keys = self.cache.k[layer][middle.index_select(0, tail.clamp(max=m - 1))].float()  # [ps, n_kv, d]
        tail_lo = keys.masked_fill(~live_tail, float("inf")).amin(dim=0)
        tail_hi = keys.masked_fill(~live_tail, float("-inf")).amax(dim=0)
        n_pages = (live + ps - 1) // ps
        scores = self.kernels.page_scores(query, self.lo[:, layer], self.hi[:, layer], row, tail_lo, tail_hi,
                                          n_full, n_pages)
        return scores, n_pages

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The bounds a step reads: ``update`` fills new pages in place before a step, and when the page axis
        grows the tensors are new ones, for which a graph is recorded again."""
        return self.lo, self.hi

    def release(self, seq_id: int) -> None:
        self.pages.pop(seq_id, None)

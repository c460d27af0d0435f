"""QUEST: query-aware page selection by per-page key bounds (Tang et al., 2024, "Quest:
Query-Aware Sparsity for Efficient Long-Context LLM Inference").

The middle of the cache is cut into pages of ``page_size`` tokens, aligned to its start (the last
page may be partial). A page is summarised by the channel-wise minimum and maximum of its keys, per
kv head. For the selection query q (the chunk's mean query; the token's own query in decode) the
page's upper bound on q_h . k for query head h, reading kv head kv(h), is

    u[h, p] = sum_c max(q[h, c] * min[p, kv(h), c], q[h, c] * max[p, kv(h), c])

QUEST selects pages per head. Our plan is shared by all heads, so pages are ranked by
max_h u[h, p]: a page is in the running as soon as one head's bound is high, which is the union of
QUEST's per-head choices. A sum over heads would let pages that many heads find moderately useful
crowd out the page a single retrieval head needs. The ``k // page_size`` best pages are attended.

The bounds of full pages are computed once and kept per sequence and layer; a selection then reads
two vectors per page, plus the keys of the partial last page.
"""

from __future__ import annotations

import torch

from ..kernels import Kernels
from ..kv_cache import KVCache
from ..transfer import arange
from .base import SelectivePolicy, SeqView, selection_query


class Quest(SelectivePolicy):
    name = "quest"

    def __init__(self, cache: KVCache, kernels: Kernels, k: int = 4096, page_size: int = 16, n_init: int = 0,
                 n_local: int = 16, positions: str = "reindex"):
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        super().__init__(cache, kernels, n_init=n_init, n_local=n_local, budget=k, positions=positions)
        self.k, self.page_size = k, page_size
        self._bounds: dict[int, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}  # seq -> layer -> (min, max)

    def select(self, layer: int, seq: SeqView, q: torch.Tensor, middle: torch.Tensor) -> torch.Tensor:
        lo, hi = self.page_bounds(layer, seq.id, middle)
        pages = self.kernels.topk(self.page_scores(selection_query(q), lo, hi), self.k // self.page_size)
        offsets = arange(self.page_size, middle.device)
        tokens = (pages[:, None] * self.page_size + offsets[None, :]).flatten()
        return tokens[tokens < middle.numel()]

    def page_bounds(self, layer: int, seq_id: int, middle: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Channel-wise min and max of each page's keys, ``[P, n_kv, d]`` fp32 each, P = ceil(M / page_size)."""
        ps, k_pool = self.page_size, self.cache.k[layer]
        full = middle.numel() // ps
        layers = self._bounds.setdefault(seq_id, {})
        empty = torch.empty(0, *k_pool.shape[1:], device=k_pool.device)
        lo, hi = layers.get(layer, (empty, empty))
        if lo.shape[0] < full:  # pages filled since the last selection
            keys = k_pool[middle[lo.shape[0] * ps:full * ps]].float().unflatten(0, (-1, ps))  # [n, ps, n_kv, d]
            lo, hi = torch.cat([lo, keys.amin(dim=1)]), torch.cat([hi, keys.amax(dim=1)])
            layers[layer] = (lo, hi)
        if full * ps < middle.numel():
            tail = k_pool[middle[full * ps:]].float()
            lo, hi = torch.cat([lo, tail.amin(dim=0, keepdim=True)]), torch.cat([hi, tail.amax(dim=0, keepdim=True)])
        return lo, hi

    @staticmethod
    def page_scores(query: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        """query: [H, d]; lo, hi: [P, n_kv, d] -> [P], the best head's upper bound on q . k."""
        group = query.shape[0] // lo.shape[1]
        lo, hi = lo.repeat_interleave(group, dim=1), hi.repeat_interleave(group, dim=1)  # [P, H, d]
        return torch.maximum(query * lo, query * hi).sum(dim=-1).amax(dim=1)

    def release(self, seq_id: int) -> None:
        self._bounds.pop(seq_id, None)

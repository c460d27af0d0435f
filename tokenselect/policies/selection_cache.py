"""The Selection Cache (TokenSelect, Algorithm 1).

Consecutive decode queries are similar, so a layer may reuse its last selection while
cos(q, q_cached) >= theta, where q is the layer's un-rotated query flattened over heads.
A miss recomputes the selection and stores it with the new query.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class SelectionCache:
    def __init__(self, theta: float | None):
        """theta: similarity threshold; None turns the cache off (every decode step selects)."""
        self.theta = theta
        self.hits = 0
        self.misses = 0
        self._entries: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def lookup(self, seq_id: int, layer: int, q: torch.Tensor) -> torch.Tensor | None:
        """q: [n_heads, head_dim]. Returns the cached selection on a hit, None on a miss."""
        if self.theta is None:
            return None
        entry = self._entries.get((seq_id, layer))
        if entry is not None and F.cosine_similarity(q.flatten(), entry[0], dim=0).item() >= self.theta:
            self.hits += 1
            return entry[1]
        self.misses += 1
        return None

    def store(self, seq_id: int, layer: int, q: torch.Tensor, chosen: torch.Tensor) -> None:
        if self.theta is not None:
            self._entries[(seq_id, layer)] = (q.flatten().float(), chosen)

    def release(self, seq_id: int) -> None:
        for key in [key for key in self._entries if key[0] == seq_id]:
            del self._entries[key]

    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

"""The Selection Cache (TokenSelect, Algorithm 1).

Consecutive decode queries are similar, so a layer may reuse its last selection while
cos(q, q_cached) >= theta, where q is the layer's un-rotated query flattened over heads.
A miss recomputes the selection and stores it with the new query.

The check is on the decode step's critical path, so it is one small product and one host read:
each entry keeps a [2, n] probe whose second row is the cached query scaled to unit length; the new
query goes into the first row, and probe @ q = (|q|^2, q . q_cached / |q_cached|).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

EPS = 1e-8  # as torch.nn.functional.cosine_similarity: a zero vector has cosine 0 with anything


@dataclass
class Entry:
    probe: torch.Tensor  # [2, n_heads * head_dim] fp32: row 0 scratch for the query, row 1 the unit cached query
    selection: object  # what the policy reuses on a hit


class SelectionCache:
    def __init__(self, theta: float | None):
        """theta: similarity threshold; None turns the cache off (every decode step selects)."""
        self.theta = theta
        self.hits = 0
        self.misses = 0
        self._entries: dict[tuple[int, int], Entry] = {}

    def lookup(self, seq_id: int, layer: int, q: torch.Tensor) -> object | None:
        """q: [n_heads, head_dim] fp32. Returns the cached selection on a hit, None on a miss."""
        if self.theta is None:
            return None
        entry = self._entries.get((seq_id, layer))
        if entry is not None and self.similarity(entry, q) >= self.theta:
            self.hits += 1
            return entry.selection
        self.misses += 1
        return None

    @staticmethod
    def similarity(entry: Entry, q: torch.Tensor) -> float:
        """cos(q, the entry's query), read back to the host."""
        probe = entry.probe
        probe[0].copy_(q.flatten())
        squared_norm, dot = torch.mv(probe, probe[0]).tolist()
        return dot / max(math.sqrt(squared_norm), EPS)

    def store(self, seq_id: int, layer: int, q: torch.Tensor, selection: object) -> None:
        """q: [n_heads, head_dim]; selection: what ``lookup`` returns on a later hit."""
        if self.theta is not None:
            q = q.flatten().float()
            probe = torch.stack([q, q / q.norm().clamp_min(EPS)])
            self._entries[(seq_id, layer)] = Entry(probe, selection)

    def release(self, seq_id: int) -> None:
        for key in [key for key in self._entries if key[0] == seq_id]:
            del self._entries[key]

    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0

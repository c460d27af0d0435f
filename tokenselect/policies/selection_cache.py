"""The Selection Cache (TokenSelect, Algorithm 1).

Consecutive decode queries are similar, so a layer may reuse its last selection while
cos(q, q_cached) >= theta, where q is the layer's un-rotated query flattened over heads.
A miss recomputes the selection and stores it with the new query.

The entries live on the device, one row per sequence: for every layer the cached query scaled to unit
length, the selection (a fixed-width int64 vector: what the policy reuses) and whether it is set. The
decision (``decide``: one kernel with the Triton kernels, ``kernels/selection_check.py``) stays on the device and
counts hits and misses there; a decode step gates its selection work with it (``policies/tokenselect.py``) and
stores or reuses in one more kernel (``update``, ``kernels/selection_update.py``), eagerly or inside a CUDA
graph alike.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..kernels.selection_check import EPS, selection_check_ref
from ..kernels.selection_update import selection_update_ref
from ..parallel import NO_REDUCE
from .rows import Rows, grown

FIRST_ROWS = 4  # rows allocated at first; the arrays double when more sequences are live


class SelectionCache:
    def __init__(self, theta: float | None, n_layers: int, width: int, check: Callable = selection_check_ref,
                 update: Callable = selection_update_ref):
        """theta: similarity threshold; None turns the cache off (every decode step selects).
        width: the length of a stored selection; check, update: the decision's and the graph store's kernels
        (``Kernels.selection_check``, ``Kernels.selection_update``)."""
        self.theta, self.n_layers, self.width = theta, n_layers, width
        self.check, self.update_kernel = check, update
        self.rows = Rows()
        self.unit: torch.Tensor | None = None  # [rows, n_layers, n] fp32: the cached queries / |q|
        self.selection: torch.Tensor | None = None  # [rows, n_layers, width] int64
        self.valid: torch.Tensor | None = None  # [rows, n_layers] bool
        self.device_counts: torch.Tensor | None = None  # [2] int64: hits, misses
        # tensor-parallel ranks (``parallel.HeadReduce``): a query is one rank's heads, the cosine spans all of them
        self.heads = NO_REDUCE
        self._norm: torch.Tensor | None = None  # the last ``decide``'s query norm over every rank, for ``update``

    # ---- rows ---------------------------------------------------------------------------------

    def row(self, seq_id: int, size: int, device: torch.device) -> int:
        """The row of ``seq_id``, assigned (empty) on first use; size: n_heads * head_dim of a query."""
        if seq_id in self.rows:
            return self.rows[seq_id]
        row = self.rows.take(seq_id)
        if self.unit is None:
            self.unit = torch.zeros(0, self.n_layers, size, dtype=torch.float32, device=device)
            self.selection = torch.zeros(0, self.n_layers, self.width, dtype=torch.int64, device=device)
            self.valid = torch.zeros(0, self.n_layers, dtype=torch.bool, device=device)
            self.device_counts = torch.zeros(2, dtype=torch.int64, device=device)
        if row >= self.unit.shape[0]:
            rows = max(FIRST_ROWS, 2 * row)
            self.unit, self.selection, self.valid = (grown(t, 0, rows) for t in (self.unit, self.selection, self.valid))
        self.valid[row] = False
        return row

    def release(self, seq_id: int) -> None:
        self.rows.release(seq_id)

    # ---- the decision -------------------------------------------------------------------------

    def decide(self, row: torch.Tensor, layer: int, q: torch.Tensor,
               live: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(miss, the selection's candidates). miss: bool [] on the device (no host read), True where the layer must
        select anew (no entry, or cos(q, its query) < theta), counted in ``device_counts``; None with the cache off
        (always select). row: int64 []; q: [n_heads, head_dim] (any float dtype: the kernel computes in fp32).
        With ``live`` (int64 []), the candidates are ``live`` on a miss and 0 on a hit, which gates the selection's
        kernels (they read nothing then), made by the check itself (no ``live * miss`` node); without it None. With
        the cache off: (None, live).
        A batch in one launch: row [B], q [B, n_heads, head_dim], live [B] -> miss and candidates [B]."""
        if self.theta is None:
            return None, live
        if self.heads.spans_ranks:
            miss = self._miss_across_ranks(q.flatten().float(), row, layer)
            return miss, None if live is None else live * miss
        candidates = None if live is None else torch.empty_like(live)
        miss = self.check(_flat(q), self.unit, self.valid, row, layer, self.theta, self.device_counts, live,
                          candidates)
        return miss, candidates

    def _miss_across_ranks(self, q: torch.Tensor, row: torch.Tensor, layer: int) -> torch.Tensor:
        """``decide``'s miss for a query split across tensor-parallel ranks by heads: each rank's unit entry is its
        part of the cached query over the whole query's norm, so the dot products and squared norms summed over the
        ranks give the one-GPU cosine (``selection_check_ref``'s test, in PyTorch, one all-reduce)."""
        index = row.view(1)
        dot = torch.dot(self.unit[:, layer].index_select(0, index)[0], q)
        total = self.heads.sum(torch.stack([dot, torch.dot(q, q)]))
        self._norm = total[1].sqrt().clamp_min(EPS)
        miss = ~(self.valid[:, layer].index_select(0, index)[0] & (total[0] >= self.theta * self._norm))
        self.device_counts += torch.stack([~miss, miss])
        return miss

    def update(self, row: torch.Tensor, layer: int, q: torch.Tensor, selection: torch.Tensor,
               miss: torch.Tensor) -> torch.Tensor:
        """A decode step's store-or-reuse, without a branch or a host read: where ``miss`` (bool [] on the
        device, from ``decide``) store q: [n_heads, head_dim] and selection: [width] in ``row`` (int64 [] on the
        device). Returns the entry after that, [width] (``selection`` on a miss, the cached one on a hit).
        A batch in one launch: row [B], q [B, n_heads, head_dim], selection [B, width], miss [B] -> [B, width]."""
        if self.heads.spans_ranks:  # the entry is the rank's part of the query over the whole query's norm
            return self._update_across_ranks(q.flatten().float() / self._norm, row, layer, selection, miss)
        return self.update_kernel(_flat(q), self.unit, self.selection, self.valid, row, layer, selection, miss)

    def _update_across_ranks(self, unit_q: torch.Tensor, row: torch.Tensor, layer: int, selection: torch.Tensor,
                             miss: torch.Tensor) -> torch.Tensor:
        """``selection_update_ref`` with the unit query given (scaled by the norm over every rank's heads)."""
        index = row.view(1)
        for table, value in ((self.unit[:, layer], unit_q), (self.selection[:, layer], selection)):
            table.index_copy_(0, index, torch.where(miss, value, table.index_select(0, index)[0])[None])
        self.valid[:, layer].index_copy_(0, index, self.valid[:, layer].index_select(0, index) | miss)
        return self.selection[:, layer].index_select(0, index)[0]

    # ---- counters -----------------------------------------------------------------------------

    def counts(self) -> tuple[int, int]:
        """(hits, misses) so far (a host read of the device's counters)."""
        return (0, 0) if self.device_counts is None else tuple(self.device_counts.tolist())


def _flat(q: torch.Tensor) -> torch.Tensor:
    """A query [n_heads, head_dim] (or [n]) -> [n]; a batch's [B, n_heads, head_dim] -> [B, n]."""
    return q.flatten(1) if q.dim() == 3 else q.flatten()

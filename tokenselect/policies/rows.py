"""Per-sequence device state: a row per live sequence in tensors that grow as needed.

Policies that remember something per sequence (the Selection Cache's entries, InfLLM's local scores and
block table, QUEST's page bounds) keep it in tensors indexed by a row, so that a step reads a sequence's
state through a device scalar (``SeqStep.row``) and a CUDA graph serves any sequence. ``Rows`` hands out
the rows; ``grown`` makes a tensor larger while keeping what it holds (a new tensor: a graph recorded with
the old one is recorded again, see ``AttentionPolicy.graph_state``).
"""

from __future__ import annotations

import torch


class Rows:
    """Sequence id -> row, the lowest free row for a new sequence."""

    def __init__(self):
        self._row: dict[int, int] = {}

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._row

    def __len__(self) -> int:
        return len(self._row)

    def __getitem__(self, seq_id: int) -> int:
        return self._row[seq_id]

    def take(self, seq_id: int) -> int:
        """The row of ``seq_id``, assigned on first use."""
        if seq_id not in self._row:
            taken = set(self._row.values())
            self._row[seq_id] = next(r for r in range(len(taken) + 1) if r not in taken)
        return self._row[seq_id]

    def release(self, seq_id: int) -> int | None:
        return self._row.pop(seq_id, None)


def grown(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """A zero tensor like ``t`` with ``size`` entries along ``dim`` (at least t's), holding t's values."""
    shape = list(t.shape)
    keep = shape[dim]
    shape[dim] = max(size, keep)
    out = t.new_zeros(shape)
    out.narrow(dim, 0, keep).copy_(t)
    return out

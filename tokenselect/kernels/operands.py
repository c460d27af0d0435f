"""How the kernels take their tensor operands: a batch's rows are read in place at their stride (rows of a graph's
slot table, a shared list at stride 0), and only the entries of a row must be one after another."""

from __future__ import annotations

import torch


def rows_in_place(t: torch.Tensor) -> torch.Tensor:
    """t itself where its last dimension is contiguous (its other dimensions are read at their strides), else a
    contiguous copy. A last dimension of one entry counts as contiguous: its stride is never used."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def batch_rows(t: torch.Tensor, batch: int) -> torch.Tensor:
    """t: [batch, ...] (or one sequence's [...] for a batch of one) -> [batch, m], each row flattened and read in
    place where it can be (``rows_in_place``)."""
    return rows_in_place(t.reshape(batch, -1))

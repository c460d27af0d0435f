"""The Selection Cache's store-or-reuse for one (sequence, layer) of a decode graph, or for a batch of sequences at
one layer, as one kernel.

    if miss:  unit[row, layer] = q / max(|q|, eps);  selection[row, layer] = new;  valid[row, layer] = True
    entry = selection[row, layer]   (after the store: ``new`` on a miss, the cached choice on a hit)

A graph can neither branch on ``miss`` nor read it on the host, so in PyTorch this is a dozen tiny kernels
(a norm and a division; a gather, a ``where`` and an ``index_copy_`` for each of the three tables; one more
gather for the entry). In a decode step captured as one CUDA graph each of them is a graph node per layer on
every step, hit or miss, where the kernel is one. The entry goes to ``out`` when given: a decode graph passes
the part of the attended list that the chosen tokens fill, so no copy follows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import dependent, wait_for_inputs
from .operands import batch_rows
from .selection_check import EPS

BLOCK = 1024


def selection_update_ref(q: torch.Tensor, unit: torch.Tensor, selection: torch.Tensor, valid: torch.Tensor,
                         row: torch.Tensor, layer: int, new: torch.Tensor, miss: torch.Tensor,
                         out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [n] (any float dtype: computed in fp32); unit: [rows, n_layers, n] fp32; selection: [rows, n_layers,
    width] int64; valid: [rows, n_layers] bool (the three updated in place); row: int64 []; new: [width] int64;
    miss: bool []. Returns the entry [width] after the update, in ``out`` ([width] int64) when given, else in a
    tensor of its own. A batch: q [B, n], row [B], new [B, width], miss [B] (rows of different sequences),
    out [B, width] -> [B, width]."""
    if q.dim() == 2:
        out = torch.empty_like(new) if out is None else out
        for b in range(q.shape[0]):
            selection_update_ref(q[b], unit, selection, valid, row[b], layer, new[b], miss[b], out[b])
        return out
    index = row.view(1)  # a device scalar: index ops (indexing with it would read it on the host)
    q = q.float()
    unit_q = q / torch.linalg.vector_norm(q).clamp_min(EPS)
    for table, value in ((unit[:, layer], unit_q), (selection[:, layer], new)):
        table.index_copy_(0, index, torch.where(miss, value, table.index_select(0, index)[0])[None])
    valid[:, layer].index_copy_(0, index, valid[:, layer].index_select(0, index) | miss)
    entry = selection[:, layer].index_select(0, index)[0]
    return entry if out is None else out.copy_(entry)


@triton.jit
def _selection_update_kernel(q_ptr, unit_ptr, sel_ptr, valid_ptr, row_ptr, new_ptr, miss_ptr, out_ptr, layer,
                             n_layers, n, width, stride_q, stride_row, stride_new, stride_out,
                             EPS: tl.constexpr, BLOCK: tl.constexpr):
    """Program = (block of BLOCK entries of the query and of the selection, sequence b): the entry's part of the
    selection (the new one on a miss, the cached one on a hit) into ``out``, and on a miss its part of both stored.
    Only a miss's programs that hold part of the query compute its norm (each the whole norm: no second kernel)."""
    wait_for_inputs()
    b = tl.program_id(1).to(tl.int64)
    q_ptr += b * stride_q
    new_ptr += b * stride_new
    out_ptr += b * stride_out
    entry = tl.load(row_ptr + b * stride_row) * n_layers + layer
    miss = tl.load(miss_ptr + b) != 0
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if miss & (tl.program_id(0) * BLOCK < n):
        sq = tl.zeros((BLOCK,), dtype=tl.float32)
        for start in range(0, n, BLOCK):
            j = start + tl.arange(0, BLOCK)
            q = tl.load(q_ptr + j, mask=j < n, other=0.0).to(tl.float32)
            sq += q * q
        norm = tl.maximum(tl.sqrt(tl.sum(sq, axis=0)), EPS)
        ok = i < n
        tl.store(unit_ptr + entry * n + i, tl.load(q_ptr + i, mask=ok, other=0.0).to(tl.float32) / norm, mask=ok)
    ok = i < width
    if miss:
        value = tl.load(new_ptr + i, mask=ok, other=0)
        tl.store(sel_ptr + entry * width + i, value, mask=ok)
    else:
        value = tl.load(sel_ptr + entry * width + i, mask=ok, other=0)
    tl.store(out_ptr + i, value, mask=ok)
    if miss & (tl.program_id(0) == 0):
        tl.store(valid_ptr + entry, tl.full((), 1, tl.uint8))


def selection_update(q: torch.Tensor, unit: torch.Tensor, selection: torch.Tensor, valid: torch.Tensor,
                     row: torch.Tensor, layer: int, new: torch.Tensor, miss: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of :func:`selection_update_ref` (same arguments, same result up to the rounding of the
    stored unit query)."""
    batch = q.shape[0] if q.dim() == 2 else 1
    qs, news = batch_rows(q, batch), batch_rows(new, batch)
    if qs.shape[1] != unit.shape[-1] or news.shape[1] != selection.shape[-1]:  # the kernel's row strides
        raise ValueError(f"a query of {qs.shape[1]} and a selection of {news.shape[1]} for entries of "
                         f"{unit.shape[-1]} and {selection.shape[-1]}")
    if out is None:
        out = torch.empty_like(new)
    elif out.shape != new.shape or out.dtype != torch.int64 or (out.dim() and out.stride(-1) != 1):
        raise ValueError(f"out must be an int64 tensor of shape {tuple(new.shape)}, each row contiguous")
    rows, misses = row.reshape(-1), miss.reshape(-1)
    if rows.numel() != batch or misses.numel() != batch or (misses.numel() > 1 and misses.stride(0) != 1):
        raise ValueError(f"{batch} queries for {rows.numel()} rows and {misses.numel()} decisions (contiguous)")
    outs = out.view(1, -1) if out.dim() == 1 else out
    grid = (triton.cdiv(max(qs.shape[1], news.shape[1]), BLOCK), batch)  # a program per BLOCK entries of either
    _selection_update_kernel[grid](qs, unit, selection, valid.view(torch.uint8), rows, news, misses.view(torch.uint8),
                                   outs, layer, unit.shape[1], qs.shape[1], news.shape[1], qs.stride(0),
                                   rows.stride(0), news.stride(0), outs.stride(0), EPS=EPS, BLOCK=BLOCK,
                                   launch_pdl=dependent(outs))
    return out

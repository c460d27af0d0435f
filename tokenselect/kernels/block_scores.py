"""Block scores (InfLLM's memory lookup): one query against the rows of a pool that an index lists.

    scores[i] = <rows[index[i]], query>   for i < n_valid,   -inf for n_valid <= i < n

InfLLM keeps every sequence's block representatives in one pool, a row of ``n_heads * head_dim`` per block, and
each sequence's list of the pool rows it holds (as the KV pool's slots are listed in a slot table). torch would
first gather the rows (a copy as large as the rows themselves); the kernel reads them in place, and only the
``n_valid`` live ones (a CUDA graph's list has a fixed length, of which a prefix is live).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import dependent, wait_for_inputs


def block_scores_ref(rows: torch.Tensor, index: torch.Tensor, query: torch.Tensor,
                     n_valid: torch.Tensor | None = None) -> torch.Tensor:
    """rows: [R, K] (fp32, bf16 or fp16), index: [n] int64 rows of it, query: [K] (any float dtype, read in fp32)
    -> scores [n] fp32. n_valid: None (all n live) or int64 [] on rows' device: entries from n_valid on score -inf
    (and their index may hold anything)."""
    n = index.numel()
    if n_valid is not None:
        live = torch.arange(n, device=rows.device) < n_valid
        index = torch.where(live, index, 0)
    scores = rows.index_select(0, index).float() @ query.float()
    return scores if n_valid is None else scores.masked_fill(~live, float("-inf"))


@triton.jit
def _block_scores_kernel(rows_ptr, index_ptr, query_ptr, out_ptr, n_valid_ptr, n, K, stride_row,
                         BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr, MASKED: tl.constexpr):
    """Program = BLOCK_B consecutive scores; a program past the live entries reads nothing and writes -inf."""
    wait_for_inputs()
    i = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    live = n
    if MASKED:
        live = tl.minimum(tl.load(n_valid_ptr).to(tl.int32), n)
    ok = i < live
    acc = tl.zeros((BLOCK_B,), dtype=tl.float32)
    if tl.program_id(0) * BLOCK_B < live:
        base = tl.load(index_ptr + i, mask=ok, other=0).to(tl.int64) * stride_row
        for start in range(0, K, BLOCK_K):
            cols = start + tl.arange(0, BLOCK_K)
            col_ok = cols < K
            x = tl.load(query_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
            r = tl.load(rows_ptr + base[:, None] + cols[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0)
            acc += tl.sum(r.to(tl.float32) * x[None, :], axis=1)
    tl.store(out_ptr + i, tl.where(ok, acc, float("-inf")), mask=i < n)


BLOCK_B, BLOCK_K = 4, 512


def block_scores(rows: torch.Tensor, index: torch.Tensor, query: torch.Tensor,
                 n_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of :func:`block_scores_ref` (same arguments, same result up to rounding)."""
    if rows.stride(1) != 1 or query.numel() != rows.shape[1]:
        raise ValueError(f"rows must have contiguous rows of the query's {query.numel()} elements, "
                         f"not {tuple(rows.shape)} with strides {rows.stride()}")
    n = index.numel()
    out = torch.empty(n, dtype=torch.float32, device=rows.device)
    if n == 0:
        return out
    _block_scores_kernel[(triton.cdiv(n, BLOCK_B),)](
        rows, index.contiguous(), query.contiguous(), out, n_valid, n, rows.shape[1], rows.stride(0),
        BLOCK_B=BLOCK_B, BLOCK_K=BLOCK_K, MASKED=n_valid is not None, launch_pdl=dependent(out))
    return out

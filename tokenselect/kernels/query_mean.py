"""A prefill chunk's selection query: the mean of its un-rotated queries (TokenSelect 5.2), accumulated in fp32.

The reference is PyTorch's mean over the chunk's rows. That reduction has one output a head element (4,096 for 32
heads of 128) to spread over the GPU and took 12 us of a 1M-token chunk's 502 on an H200
(results/supporting/attention_chunk_profile_h200.md), and its cast to the queries' dtype 1 us more. Here a program
sums a block of 32 columns over every row of its sequence, so a chunk of 512 queries of 32 heads runs 128 programs
each reading 32 KB, in the order of its rows (the same sum every time), and writes the mean in the dtype asked for:
no second kernel to cast it. On an H200, in CUDA graphs (results/supporting/topk_settled_h200.md): 5.6 us against
PyTorch's 9.7 for 512 queries, 9.3 against 10.1 for four groups of 512; but 18.4 against 12.1 for one chunk of 2048,
where each program's rows run one after another while PyTorch's reduction splits them. So chunks of more than
``MAX_ROWS`` queries take PyTorch's mean.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import dependent, wait_for_inputs


def query_mean_ref(q: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q: [c, n_heads, head_dim] (a view of any token stride) -> [n_heads, head_dim], the mean over c accumulated in
    fp32, in ``dtype``; a batch's [B, c, n_heads, head_dim] (a chunk's groups of queries) -> [B, n_heads, head_dim]."""
    return q.mean(dim=-3, dtype=torch.float32).to(dtype)


@triton.jit
def _query_mean_kernel(q_ptr, out_ptr, C, WIDTH, inv_c, stride_b, stride_tok, BLOCK_ROWS: tl.constexpr,
                       BLOCK_COLS: tl.constexpr):
    """Program = (block of columns, sequence b): out[b, cols] = sum over the C rows of q[b, :, cols], times inv_c,
    added in the rows' order in fp32, stored in out's dtype. A row's WIDTH columns are contiguous."""
    wait_for_inputs()
    b = tl.program_id(1).to(tl.int64)
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_ok = cols < WIDTH
    q_ptr += b * stride_b
    acc = tl.zeros((BLOCK_COLS,), dtype=tl.float32)
    for start in range(0, C, BLOCK_ROWS):
        rows = start + tl.arange(0, BLOCK_ROWS)
        x = tl.load(q_ptr + rows.to(tl.int64)[:, None] * stride_tok + cols[None, :],
                    mask=(rows < C)[:, None] & col_ok[None, :], other=0.0)
        acc += tl.sum(x.to(tl.float32), axis=0)
    tl.store(out_ptr + b * WIDTH + cols, (acc * inv_c).to(out_ptr.dtype.element_ty), mask=col_ok)


BLOCK_ROWS, BLOCK_COLS = 64, 32
MAX_ROWS = 512  # the longest chunk measured faster here than PyTorch's mean (above)


def query_mean(q: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Triton version of :func:`query_mean_ref` (same arguments); a chunk of more than MAX_ROWS queries is that
    function's. Each head's values must be contiguous and the heads of a token adjacent (a view of the model's q, k,
    v product is); anything else is copied first."""
    batched = q.dim() == 4
    qs = q if batched else q[None]
    batch, c, n_heads, d = qs.shape
    if c > MAX_ROWS:
        return query_mean_ref(q, dtype)
    if qs.stride(3) != 1 or qs.stride(2) != d:
        qs = qs.contiguous()
    out = torch.empty(batch, n_heads, d, dtype=dtype, device=q.device)
    if c and batch:
        width = n_heads * d
        _query_mean_kernel[(triton.cdiv(width, BLOCK_COLS), batch)](
            qs, out, c, width, 1.0 / c, qs.stride(0), qs.stride(1), BLOCK_ROWS=BLOCK_ROWS, BLOCK_COLS=BLOCK_COLS,
            launch_pdl=dependent(out))
    else:
        out.fill_(float("nan"))  # the mean of no rows, as PyTorch's
    return out if batched else out[0]

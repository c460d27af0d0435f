"""Row copies, run by the GPU, between device tensors and a pool in page-locked host memory.

With value offload (``kv_cache.py``) the V pool lives in host memory that is page-locked and mapped into
the GPU's address space, so a kernel reads and writes it in place over the bus. Gathering the attended
rows this way needs no host read of the slot list and no copy on the CPU: a step stays on the device
(and fits in a CUDA graph).

    gather_rows(pool, index) = pool[index]       pool: [S, *row], index: [n] -> [n, *row] on index's device
    scatter_rows(rows, pool, index):  pool[index] = rows     rows: [n, *row] (index without repeats)

Each row moves as 32-bit words (as bytes when its size or a tensor's start is not a multiple of 4), a block
of rows per program. Pool and rows must be contiguous, as a layer of the KV pool is.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_ROWS = 16
BLOCK_WORDS = 256  # 1 KiB of a row per load: a whole fp8 row of Llama-3-8B's 8 kv heads x 128


def _raw(t: torch.Tensor) -> torch.Tensor:
    """[R, *row] contiguous -> [R, row bytes] as uint8, sharing t's memory."""
    if not t.is_contiguous():
        raise ValueError("row copies need contiguous tensors (rows one after another)")
    return t.view(t.shape[0], -1).view(torch.uint8)


def gather_rows_ref(pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """pool: [S, *row] (any device), index: [n] int64 -> pool[index]: [n, *row] on index's device."""
    rows = _raw(pool)[index.to(pool.device)].to(index.device)
    return rows.view(pool.dtype).view(index.numel(), *pool.shape[1:])


def scatter_rows_ref(rows: torch.Tensor, pool: torch.Tensor, index: torch.Tensor) -> None:
    """pool[index] = rows. rows: [n, *row] of pool's dtype; index: [n] int64 without repeats."""
    _raw(pool)[index.to(pool.device)] = _raw(rows).to(pool.device)


@triton.jit
def _copy_rows_kernel(src_ptr, dst_ptr, index_ptr, n, words, GATHER: tl.constexpr, BLOCK_R: tl.constexpr,
                      BLOCK_W: tl.constexpr):
    """Program = block of BLOCK_R of the n rows. GATHER: dst[r] = src[index[r]]; else dst[index[r]] = src[r].
    Rows are ``words`` elements long."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n
    picked = tl.load(index_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    if GATHER:
        src_row, dst_row = picked * words, rows.to(tl.int64) * words
    else:
        src_row, dst_row = rows.to(tl.int64) * words, picked * words
    for start in range(0, words, BLOCK_W):
        cols = start + tl.arange(0, BLOCK_W)
        mask = row_ok[:, None] & (cols < words)[None, :]
        values = tl.load(src_ptr + src_row[:, None] + cols[None, :], mask=mask)
        tl.store(dst_ptr + dst_row[:, None] + cols[None, :], values, mask=mask)


def _launch(src: torch.Tensor, dst: torch.Tensor, index: torch.Tensor, gather: bool) -> None:
    """src, dst: [*, row bytes] uint8 views; moves whole rows as int32 words when their layout allows."""
    if src.shape[1] != dst.shape[1]:
        raise ValueError(f"rows of {src.shape[1]} bytes cannot be copied to rows of {dst.shape[1]} bytes")
    if index.dtype != torch.int64:
        raise ValueError(f"index must be int64, not {index.dtype}")
    n = index.numel()
    if src.shape[1] % 4 == 0 and src.storage_offset() % 4 == 0 and dst.storage_offset() % 4 == 0:
        src, dst = src.view(torch.int32), dst.view(torch.int32)
    _copy_rows_kernel[(triton.cdiv(n, BLOCK_ROWS),)](src, dst, index, n, src.shape[1], GATHER=gather,
                                                     BLOCK_R=BLOCK_ROWS, BLOCK_W=BLOCK_WORDS)


def gather_rows(pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`gather_rows_ref`; pool may be page-locked host memory mapped for the GPU."""
    out = torch.empty(index.numel(), *pool.shape[1:], dtype=pool.dtype, device=index.device)
    if index.numel():
        _launch(_raw(pool), _raw(out), index, gather=True)
    return out


def scatter_rows(rows: torch.Tensor, pool: torch.Tensor, index: torch.Tensor) -> None:
    """Triton version of :func:`scatter_rows_ref`; pool may be page-locked host memory mapped for the GPU."""
    if rows.dtype != pool.dtype or rows.shape[1:] != pool.shape[1:]:
        raise ValueError(f"rows {rows.dtype} {tuple(rows.shape)} do not match the pool's {pool.dtype} "
                         f"{tuple(pool.shape)}")
    if index.numel():
        _launch(_raw(rows.contiguous()), _raw(pool), index, gather=False)

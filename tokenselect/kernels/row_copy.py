"""Row copies run by the GPU: the KV cache's writes, and the gathers and scatters of a pool in page-locked host
memory.

    gather_rows(pool, index) = pool[index]       pool: [S, *row], index: [n] -> [n, *row] on index's device
    scatter_rows([(rows, pool), ...], index):  pool[index] = rows for every pair    rows: [n, *row]
    gather_into(src, index, out):  out[:] = src[index]     src: [S], index, out: [n] (one value a row), or
                                   out[b] = src[b][index[b]] for a batch: src [B, S], index, out [B, n]

A step writes each layer's new keys and values, and with ``select_dtype`` the keys' copy, into their pools
(``KVCache.write``): as ``index_put`` that is a kernel per pool, and in a decode step captured as one graph
(``cuda_graphs.py``) a node per pool and layer; ``scatter_rows`` writes up to three pools in one launch. The
rows may be views of one wider tensor (the keys and values are slices of the q/k/v product's rows): only each
row must be contiguous.

With value offload (``kv_cache.py``) the V pool lives in host memory that is page-locked and mapped into
the GPU's address space, so a kernel reads and writes it in place over the bus. Gathering the attended
rows this way needs no host read of the slot list and no copy on the CPU: a step stays on the device
(and fits in a CUDA graph).

``stage_rows`` is such a gather for a policy's attended rows, from a step to the next: the rows it stages are kept on
the device (``kept``: a layer's last staged rows, the slot each holds, and for each slot the kept row that last held
it), and a slot found there is copied from the device instead of over the bus. A decode step's choice shares most of
its tokens with the step before it (always its sinks and window), so most rows cross the bus once, not every step.

    stage_rows(pool, index, kept) -> out [n, *row] = pool[index];  kept.rows[:m] = out[:m], m = min(n, kept rows)

``gather_into`` is a selective layer's one gather, the chosen tokens' slots out of the middle of the slot table
into the attended list: 1.5 us in a decode graph on an H100, where ``torch.index_select(..., out=)`` runs as a
``gather`` kernel of 4.6 us (``benchmarks/middle_gather_gpu.py``), once a layer and step.

Each row moves as 32-bit words (as bytes when its size, its stride or a tensor's start is not a multiple of 4),
a block of rows per program. Pools must be contiguous, as a layer of the KV pool is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .launch import dependent, wait_for_inputs

MAX_PAIRS = 3  # (rows, pool) pairs one scatter launch writes: K, V and the selection keys' copy
BLOCK_ROWS = 16
BLOCK_WORDS = 256  # 1 KiB of a row per load: a whole fp8 row of Llama-3-8B's 8 kv heads x 128


def _raw(t: torch.Tensor) -> torch.Tensor:
    """[R, *row] contiguous -> [R, row bytes] as uint8, sharing t's memory."""
    if not t.is_contiguous():
        raise ValueError("row copies need contiguous tensors (rows one after another)")
    return t.view(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)


def _raw_rows(t: torch.Tensor) -> torch.Tensor:
    """[R, *row] whose rows are each contiguous (row 0's stride may be anything) -> [R, row bytes] as uint8,
    sharing t's memory; a copy when a row is not contiguous."""
    if not t[:1].is_contiguous():
        t = t.contiguous()
    return t.flatten(1).view(torch.uint8)


def gather_rows_ref(pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """pool: [S, *row] (any device), index: [n] int64 -> pool[index]: [n, *row] on index's device."""
    rows = _raw(pool)[index.to(pool.device)].to(index.device)
    return rows.view(pool.dtype).view(index.numel(), *pool.shape[1:])


def gather_into_ref(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """src: [S], index: [n] int64, out: [n] of src's dtype -> out, holding src[index]. A batch: src [B, S],
    index [B, n], out [B, n] (views of any strides), each row gathered from its own row of src."""
    if src.dim() == 2:
        return out.copy_(torch.gather(src, 1, index))
    return torch.index_select(src, 0, index, out=out)


@dataclass
class Kept:
    """A layer's staged rows kept on the device for the next ``stage_rows``: ``rows [R, *row]`` (the pool's row), the
    slot each holds (``slot [R]`` int64, -1: none), where a slot was last kept (``row_of [S]`` int32 over the pool's
    slots, -1: nowhere; a stale entry is caught by ``slot``), and the counts staged and found kept so far
    (``counts [2]`` int64, for the benches). A slot written since must not be found: ``scatter_rows`` sets its
    ``row_of`` to -1 (``forget``) where it writes the pool. (Not when it is freed: a graph's padded list may stage a
    freed slot's old row, and keep it, before the slot is written again.)"""

    rows: torch.Tensor
    slot: torch.Tensor
    row_of: torch.Tensor
    counts: torch.Tensor

    @classmethod
    def empty(cls, n_rows: int, pool: torch.Tensor, device: torch.device | str,
              counts: torch.Tensor | None = None) -> Kept:
        """Nothing kept yet, room for ``n_rows`` rows of ``pool [S, *row]`` on ``device``; counts: the [2] int64 to
        add to (one for a cache's every layer), or new ones."""
        return cls(torch.empty(n_rows, *pool.shape[1:], dtype=pool.dtype, device=device),
                   torch.full((n_rows,), -1, dtype=torch.int64, device=device),
                   torch.full((pool.shape[0],), -1, dtype=torch.int32, device=device),
                   torch.zeros(2, dtype=torch.int64, device=device) if counts is None else counts)


def stage_rows_ref(pool: torch.Tensor, index: torch.Tensor, kept: Kept) -> torch.Tensor:
    """pool: [S, *row] (any device), index: [n] int64 on kept's device -> pool[index]: [n, *row] there, each row found
    in ``kept`` copied from it, the others gathered from the pool; then the first min(n, R) rows are kept."""
    at = kept.row_of[index].long()
    held = (at >= 0) & ((kept.slot[at.clamp(min=0)] == index) if kept.slot.numel() else False)
    out = torch.empty(index.numel(), *pool.shape[1:], dtype=pool.dtype, device=index.device)
    out[held] = kept.rows[at[held]]
    out[~held] = gather_rows_ref(pool, index[~held])
    m = min(index.numel(), kept.slot.numel())
    kept.rows[:m], kept.slot[:m] = out[:m], index[:m]
    kept.row_of[index[:m]] = torch.arange(m, dtype=torch.int32, device=index.device)
    kept.counts[0] += index.numel()
    kept.counts[1] += held.sum()
    return out


def scatter_rows_ref(pairs, index: torch.Tensor, forget: torch.Tensor | None = None) -> None:
    """For each (rows, pool) of pairs: pool[index] = rows. rows: [n, *row] of pool's dtype (each row contiguous);
    pool: [S, *row] contiguous; index: [n] int64 without repeats. forget: None, or a ``Kept.row_of`` [S]: the
    written slots are no longer found kept (forget[index] = -1)."""
    pairs = _checked(pairs, index)
    if forget is not None:
        forget[index] = -1
    for rows, pool in pairs:
        _raw(pool)[index.to(pool.device)] = _raw_rows(rows).to(pool.device)


def _checked(pairs, index: torch.Tensor):
    pairs = list(pairs)
    if not 0 < len(pairs) <= MAX_PAIRS:
        raise ValueError(f"scatter_rows writes 1 to {MAX_PAIRS} pools at once, not {len(pairs)}")
    for rows, pool in pairs:
        if rows.dtype != pool.dtype or rows.shape[1:] != pool.shape[1:]:
            raise ValueError(f"rows {rows.dtype} {tuple(rows.shape)} do not match the pool's {pool.dtype} "
                             f"{tuple(pool.shape)}")
        if rows.shape[0] != index.numel() or rows.device != index.device:
            raise ValueError(f"{rows.shape[0]} rows on {rows.device} for {index.numel()} slots on {index.device}")
    return pairs


@triton.jit
def _copy_block(src_ptr, dst_ptr, src_row, dst_row, row_ok, words, BLOCK_W: tl.constexpr):
    """dst[dst_row[r] + c] = src[src_row[r] + c] for the rows r where row_ok and c < words."""
    for start in range(0, words, BLOCK_W):
        cols = start + tl.arange(0, BLOCK_W)
        mask = row_ok[:, None] & (cols < words)[None, :]
        values = tl.load(src_ptr + src_row[:, None] + cols[None, :], mask=mask)
        tl.store(dst_ptr + dst_row[:, None] + cols[None, :], values, mask=mask)


@triton.jit
def _gather_kernel(src_ptr, dst_ptr, index_ptr, n, words, BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """Program = block of BLOCK_R of the n rows: dst[r] = src[index[r]], rows ``words`` elements long."""
    wait_for_inputs()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n
    picked = tl.load(index_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    _copy_block(src_ptr, dst_ptr, picked * words, rows.to(tl.int64) * words, row_ok, words, BLOCK_W)


@triton.jit
def _stage_kernel(pool_ptr, kept_ptr, kept_slot_ptr, row_of_ptr, index_ptr, out_ptr, counts_ptr, n, words,
                  BLOCK_R: tl.constexpr, BLOCK_W: tl.constexpr):
    """Program = block of BLOCK_R of the n rows: out[r] = kept[j] if the slot index[r] was last kept at a row j that
    still holds it, else pool[index[r]] (rows ``words`` elements long; a kept row is not read from the pool); counts
    += (rows, rows found kept)."""
    wait_for_inputs()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n
    slot = tl.load(index_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    at = tl.load(row_of_ptr + slot, mask=row_ok, other=-1).to(tl.int64)
    held = row_ok & (at >= 0)
    held = held & (tl.load(kept_slot_ptr + at, mask=held, other=-1) == slot)
    fetched = row_ok & ~held
    out_row = rows.to(tl.int64) * words
    for start in range(0, words, BLOCK_W):
        cols = start + tl.arange(0, BLOCK_W)
        col_ok = (cols < words)[None, :]
        from_kept = tl.load(kept_ptr + at[:, None] * words + cols[None, :], mask=held[:, None] & col_ok)
        from_pool = tl.load(pool_ptr + slot[:, None] * words + cols[None, :], mask=fetched[:, None] & col_ok)
        tl.store(out_ptr + out_row[:, None] + cols[None, :], tl.where(held[:, None], from_kept, from_pool),
                 mask=row_ok[:, None] & col_ok)
    tl.atomic_add(counts_ptr, tl.sum(row_ok.to(tl.int64), axis=0))
    tl.atomic_add(counts_ptr + 1, tl.sum(held.to(tl.int64), axis=0))


@triton.jit
def _keep_kernel(out_ptr, index_ptr, kept_ptr, kept_slot_ptr, row_of_ptr, m, words, BLOCK_R: tl.constexpr,
                 BLOCK_W: tl.constexpr):
    """Program = block of BLOCK_R of the first m rows: kept[r] = out[r], kept_slot[r] = index[r],
    row_of[index[r]] = r (a separate launch from ``_stage_kernel``, which reads the rows this overwrites)."""
    wait_for_inputs()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < m
    slot = tl.load(index_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    rows64 = rows.to(tl.int64) * words
    _copy_block(out_ptr, kept_ptr, rows64, rows64, row_ok, words, BLOCK_W)
    tl.store(kept_slot_ptr + rows, slot, mask=row_ok)
    tl.store(row_of_ptr + slot, rows, mask=row_ok)


@triton.jit
def _scatter_kernel(index_ptr, n, src0, dst0, stride0, words0, src1, dst1, stride1, words1, src2, dst2, stride2,
                    words2, forget_ptr, PAIRS: tl.constexpr, FORGET: tl.constexpr, BLOCK_R: tl.constexpr,
                    BLOCK_W: tl.constexpr):
    """Program (block of BLOCK_R of the n rows, pair p < PAIRS): dst_p[index[r]] = src_p[r], rows ``words_p``
    elements long, src_p's rows ``stride_p`` elements apart (the pairs a launch does not use are not read);
    FORGET: pair 0's programs also set forget[index[r]] = -1."""
    wait_for_inputs()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n
    picked = tl.load(index_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    pair = tl.program_id(1)
    rows = rows.to(tl.int64)
    if pair == 0:
        _copy_block(src0, dst0, rows * stride0, picked * words0, row_ok, words0, BLOCK_W)
        if FORGET:
            tl.store(forget_ptr + picked, tl.full((BLOCK_R,), -1, tl.int32), mask=row_ok)
    if PAIRS > 1:
        if pair == 1:
            _copy_block(src1, dst1, rows * stride1, picked * words1, row_ok, words1, BLOCK_W)
    if PAIRS > 2:
        if pair == 2:
            _copy_block(src2, dst2, rows * stride2, picked * words2, row_ok, words2, BLOCK_W)


@triton.jit
def _gather_into_kernel(src_ptr, index_ptr, out_ptr, n, src_stride, src_row, index_row, out_row, out_stride,
                        BLOCK: tl.constexpr):
    """Program = (block of BLOCK entries i, row b): out[b, i] = src[b, index[b, i]] (rows and entries at the given
    strides; the index's entries contiguous)."""
    wait_for_inputs()
    b = tl.program_id(1).to(tl.int64)
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    at = tl.load(index_ptr + b * index_row + i, mask=ok, other=0)
    tl.store(out_ptr + b * out_row + i * out_stride, tl.load(src_ptr + b * src_row + at * src_stride, mask=ok),
             mask=ok)


GATHER_BLOCK = 256  # entries a program: 1.51 us for 2,048 in a graph on an H100, 1.89 us at 1,024


def _words(src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """src: [n, row bytes] uint8 (rows stride(0) apart), dst: [S, row bytes] uint8 -> both as int32 words when
    every row's start in both is a multiple of 4 bytes, else as they are."""
    if src.shape[1] != dst.shape[1]:
        raise ValueError(f"rows of {src.shape[1]} bytes cannot be copied to rows of {dst.shape[1]} bytes")
    aligned = (src.shape[1] % 4 == 0 and src.stride(0) % 4 == 0 and src.storage_offset() % 4 == 0
               and dst.storage_offset() % 4 == 0)
    return (src.view(torch.int32), dst.view(torch.int32)) if aligned else (src, dst)


def _check_index(index: torch.Tensor) -> None:
    if index.dtype != torch.int64:
        raise ValueError(f"index must be int64, not {index.dtype}")


def gather_rows(pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`gather_rows_ref`; pool may be page-locked host memory mapped for the GPU."""
    _check_index(index)
    out = torch.empty(index.numel(), *pool.shape[1:], dtype=pool.dtype, device=index.device)
    if index.numel():
        src, dst = _words(_raw(pool), _raw(out))
        _gather_kernel[(triton.cdiv(index.numel(), BLOCK_ROWS),)](src, dst, index, index.numel(), src.shape[1],
                                                                  BLOCK_R=BLOCK_ROWS, BLOCK_W=BLOCK_WORDS,
                                                                  launch_pdl=dependent(dst))
    return out


def stage_rows(pool: torch.Tensor, index: torch.Tensor, kept: Kept) -> torch.Tensor:
    """Triton version of :func:`stage_rows_ref`; pool may be page-locked host memory mapped for the GPU."""
    _check_index(index)
    out = torch.empty(index.numel(), *pool.shape[1:], dtype=pool.dtype, device=index.device)
    n, m = index.numel(), min(index.numel(), kept.slot.numel())
    if n:
        src, dst = _words(_raw(pool), _raw(out))
        rows = _raw(kept.rows).view(dst.dtype)
        words, pdl = src.shape[1], dependent(dst)
        _stage_kernel[(triton.cdiv(n, BLOCK_ROWS),)](src, rows, kept.slot, kept.row_of, index, dst, kept.counts, n,
                                                     words, BLOCK_R=BLOCK_ROWS, BLOCK_W=BLOCK_WORDS, launch_pdl=pdl)
        if m:
            _keep_kernel[(triton.cdiv(m, BLOCK_ROWS),)](dst, index, rows, kept.slot, kept.row_of, m, words,
                                                        BLOCK_R=BLOCK_ROWS, BLOCK_W=BLOCK_WORDS, launch_pdl=pdl)
    return out


def gather_into(src: torch.Tensor, index: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`gather_into_ref` (src and out may be strided; index's rows must be contiguous)."""
    _check_index(index)
    dims = src.dim()
    if dims not in (1, 2) or index.dim() != dims or out.shape != index.shape or out.dtype != src.dtype \
            or (dims == 2 and src.shape[0] != index.shape[0]) or (index.numel() > 1 and index.stride(-1) != 1):
        raise ValueError(f"gather_into needs a src of 1 (or, for a batch, 2) dims, an index and an out of as many, the "
                         f"out of the index's shape and the src's dtype, the index's rows contiguous; got src "
                         f"{src.dtype} {tuple(src.shape)}, index {tuple(index.shape)}, "
                         f"out {out.dtype} {tuple(out.shape)}")
    src2, index2, out2 = (t if dims == 2 else t[None] for t in (src, index, out))
    n = index2.shape[1]
    if index.numel():
        _gather_into_kernel[(triton.cdiv(n, GATHER_BLOCK), index2.shape[0])](
            src2, index2, out2, n, src2.stride(1), src2.stride(0), index2.stride(0), out2.stride(0), out2.stride(1),
            BLOCK=GATHER_BLOCK, launch_pdl=dependent(out2))
    return out


def scatter_rows(pairs, index: torch.Tensor, forget: torch.Tensor | None = None) -> None:
    """Triton version of :func:`scatter_rows_ref`, one launch for every pair; a pool may be page-locked host
    memory mapped for the GPU."""
    pairs = _checked(pairs, index)
    _check_index(index)
    if not index.numel():
        return
    args = []
    for rows, pool in pairs:
        src, dst = _words(_raw_rows(rows), _raw(pool))
        args += [src, dst, src.stride(0), src.shape[1]]
    args += args[:4] * (MAX_PAIRS - len(pairs))  # the unused pairs' arguments: never read
    _scatter_kernel[(triton.cdiv(index.numel(), BLOCK_ROWS), len(pairs))](
        index, index.numel(), *args, forget, PAIRS=len(pairs), FORGET=forget is not None, BLOCK_R=BLOCK_ROWS,
        BLOCK_W=BLOCK_WORDS, launch_pdl=dependent(index))

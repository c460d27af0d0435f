"""Paged argmax (ReAttention's vote): each query row's best key by un-rotated dot product, read in place through
a slot list, without writing the scores.

    best[r] = argmax_t <q[r], k_pool[slots[t], r // rows_per_kv]>   over t < n_valid, the first of equal maxima

The rows are head-major, ``[n_kv * rows_per_kv, d]``: the rows of kv head j are j * rows_per_kv onwards, which is
how ReAttention lays out a chunk's (query head, query) pairs. A program takes BLOCK_R rows of one kv head and walks
one split of the live slots in blocks of BLOCK_N keys, keeping each row's running maximum and where it was: the keys
are read once per BLOCK_R rows and the [rows, N] scores never reach memory. (Scoring through ``paged_dot`` wrote them
and ran a top-k over them, a prefill's worth of full attention's memory traffic in every layer.) The splits let a
decode step's few rows, and a chunk's rows in large tiles, fill the GPU; each writes its rows' best, and the first
split holding a row's maximum wins.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dot import as_dot_type, exact_dot_type, mma
from .launch import dependent, wait_for_inputs
from .paged_dot import paged_dot_ref
from .sparse_attention import TARGET_PROGRAMS
from .splits import key_splits, live_keys_per_split

REF_SCORES = 1 << 24  # the reference scores blocks of rows, at most this many floats at a time


def paged_argmax_ref(q: torch.Tensor, k_pool: torch.Tensor, slots: torch.Tensor,
                     n_valid: torch.Tensor | None = None) -> torch.Tensor:
    """q: [R, d] head-major (R = n_kv * rows_per_kv), k_pool: [S, n_kv, d], slots: [N], n_valid: None or int64 []
    (only slots[:n_valid] are candidates) -> [R] int64: the index into ``slots`` of each row's largest score, the
    first of equal ones (0 where no slot is live). The scores are ``paged_dot_ref``'s, for a block of each kv
    head's rows at a time."""
    n_kv, d, n = k_pool.shape[1], q.shape[1], slots.numel()
    best = torch.zeros(q.shape[0], dtype=torch.int64, device=q.device)
    if n == 0:
        return best
    by_kv, best_by_kv = q.reshape(n_kv, -1, d), best.view(n_kv, -1)  # [n_kv, rows_per_kv, ...]
    dead = None if n_valid is None else torch.arange(n, device=slots.device) >= n_valid
    step = max(1, REF_SCORES // (n_kv * n))
    for start in range(0, by_kv.shape[1], step):
        part = by_kv[:, start:start + step]
        scores = paged_dot_ref(part.reshape(-1, d), k_pool, slots)  # [n_kv * rows, N] fp32, head-major
        if dead is not None:
            scores = scores.masked_fill(dead, float("-inf"))
        best_by_kv[:, start:start + step] = scores.argmax(dim=1).view(n_kv, -1)  # the first of equal maxima
    return best


@triton.jit
def _argmax_kernel(q_ptr, k_ptr, slot_ptr, best_ptr, where_ptr, n_valid_ptr, N, per_kv, keys_per_split, stride_slot,
                   stride_kvh, D: tl.constexpr, D_P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                   DOT_TY: tl.constexpr, IEEE: tl.constexpr, MASKED: tl.constexpr):
    """Program (row tile, kv head, split): for the tile's rows r of that kv head, the best score among the split's
    keys and where it is (best[split, r], where[split, r]; -inf and 0 for a split past the live keys). A later
    block replaces a row's best only with a strictly larger score, and within a block the leftmost maximum wins:
    the first of equal maxima within the split, as ``torch.argmax``. With MASKED the live keys, read on the device,
    are shared out among the splits that the grid planned for all N."""
    wait_for_inputs()
    tile, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n_live = N
    if MASKED:
        n_live = tl.minimum(tl.load(n_valid_ptr).to(tl.int32), N)
        keys_per_split = live_keys_per_split(n_live, BLOCK_N)
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, n_live)
    rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
    dims = tl.arange(0, D_P)  # D padded to a power of two
    row_ok, dim_ok = rows < per_kv, dims < D
    q_rows = (kvh * per_kv + rows).to(tl.int64)
    q = as_dot_type(tl.load(q_ptr + q_rows[:, None] * D + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :],
                            other=0.0), DOT_TY)
    best = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    where = tl.zeros((BLOCK_R,), tl.int32)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        live = cols < hi
        slots = tl.load(slot_ptr + cols, mask=live, other=0).to(tl.int64)
        # each key's row read whole (contiguous in the pool), then transposed in registers for the product
        k = tl.load(k_ptr + slots[:, None] * stride_slot + kvh * stride_kvh + dims[None, :],
                    mask=live[:, None] & dim_ok[None, :], other=0.0)
        s = tl.where(live[None, :], mma(q, tl.trans(k.to(DOT_TY)), IEEE), float("-inf"))  # [BLOCK_R, BLOCK_N]
        m = tl.max(s, axis=1)
        i = tl.argmax(s, axis=1, tie_break_left=True)
        better = m > best
        where = tl.where(better, start + i, where)
        best = tl.where(better, m, best)
    out = split * (tl.num_programs(1) * per_kv) + q_rows
    tl.store(best_ptr + out, best, mask=row_ok)
    tl.store(where_ptr + out, where.to(tl.int64), mask=row_ok)


# (rows, keys per block, warps, pipeline stages), measured on an H200 (results/supporting/reattention_vote_h200.md):
# a chunk's thousands of rows a kv head in tiles of 128 (each key block read for 128 rows), a decode step's few rows
# (at most FEW_ROWS a kv head) in tiles of 32; fp32 products run on CUDA cores with fp32 operands, in smaller blocks
ARGMAX_TILE, FEW_ROWS_ARGMAX_TILE, FP32_ARGMAX_TILE = (128, 64, 8, 3), (32, 128, 4, 3), (32, 64, 4, 2)
FEW_ROWS = 32
MIN_SPLIT_BLOCKS = 4  # blocks of keys a split walks at least (the splits aim at sparse attention's TARGET_PROGRAMS:
# a decode step's few rows, or a chunk's rows in large tiles, would leave most SMs idle)


def paged_argmax(q: torch.Tensor, k_pool: torch.Tensor, slots: torch.Tensor, n_valid: torch.Tensor | None = None,
                 tile: tuple[int, int, int, int] | None = None, splits: int | None = None) -> torch.Tensor:
    """Triton version of :func:`paged_argmax_ref` (same arguments; the same indices wherever two scores differ by
    more than rounding). The keys are split among programs (``TARGET_PROGRAMS``); each split's best of every row is
    written, and the first split holding a row's maximum gives its pick (the splits are in key order, so that is
    the first of equal maxima overall). tile, splits: a benchmark's or test's choice instead of the planned ones."""
    n_kv, d, n = k_pool.shape[1], q.shape[1], slots.numel()
    per_kv = q.shape[0] // n_kv
    if n == 0 or per_kv == 0:
        return torch.zeros(q.shape[0], dtype=torch.int64, device=q.device)
    dot_ty, ieee = exact_dot_type(q.dtype, k_pool.dtype)
    block_r, block_n, warps, stages = tile or (FP32_ARGMAX_TILE if ieee else
                                               FEW_ROWS_ARGMAX_TILE if per_kv <= FEW_ROWS else ARGMAX_TILE)
    if d > 128 and tile is None:
        block_n //= 2
    row_tiles = triton.cdiv(per_kv, block_r)
    splits, keys_per_split = key_splits(n, block_n, splits or TARGET_PROGRAMS // (row_tiles * n_kv),
                                        1 if splits else MIN_SPLIT_BLOCKS)
    best = torch.empty(splits, q.shape[0], dtype=torch.float32, device=q.device)
    where = torch.empty(splits, q.shape[0], dtype=torch.int64, device=q.device)
    _argmax_kernel[(row_tiles, n_kv, splits)](
        q.contiguous(), k_pool, slots.contiguous(), best, where, n_valid, n, per_kv, keys_per_split,
        k_pool.stride(0), k_pool.stride(1), D=d, D_P=max(16, triton.next_power_of_2(d)), BLOCK_R=block_r,
        BLOCK_N=block_n, DOT_TY=dot_ty, IEEE=ieee, MASKED=n_valid is not None, num_warps=warps, num_stages=stages,
        launch_pdl=dependent(best))
    if splits == 1:
        return where[0]
    return where.gather(0, best.argmax(dim=0, keepdim=True))[0]  # argmax: the first split of equal maxima

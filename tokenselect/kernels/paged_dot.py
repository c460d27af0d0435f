"""Paged dot product (TokenSelect, Algorithm 2): per-head scores of one query against cached keys
read in place through a slot list.

    scores[h, t] = <q[h], k_pool[slots[t], h // group]>,   group = n_heads // n_kv_heads

Keys are the un-rotated (pre-RoPE) keys of the cache, so the scores are position-agnostic. The
Triton kernel never gathers the keys into a new tensor: each program reads one block of slots of
one kv head (every key row once) and scores it against the whole query group of that head. The kv
head is the grid's fastest axis, so the programs that read the n_kv parts of the same slots' rows
run side by side (one slot's keys are one contiguous row of the pool); a program may score several
consecutive blocks. The same kernel optionally writes per-block softmax statistics, which the head
soft vote builds on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dot import as_dot_type, exact_dot_type, mma
from .fast_exp import exp_ftz
from .launch import dependent, wait_for_inputs
from .operands import rows_in_place


def paged_dot_ref(q: torch.Tensor, k_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """q: [n_heads, head_dim], k_pool: [n_slots, n_kv_heads, head_dim], slots: [N] -> scores [n_heads, N] fp32."""
    n_heads, n_kv = q.shape[0], k_pool.shape[1]
    keys = k_pool[slots].float()  # [N, n_kv, d]
    qg = q.float().view(n_kv, n_heads // n_kv, -1)  # [n_kv, group, d]
    return torch.einsum("kgd,nkd->kgn", qg, keys).reshape(n_heads, -1)


@triton.jit
def _scores_kernel(q_ptr, k_ptr, slot_ptr, out_ptr, m_ptr, l_ptr, n_valid_ptr, N, G, n_kv, n_blocks, scale,
                   stride_slot, stride_kvh, stride_qb, stride_slot_row, stride_valid, fold, stride_out, D: tl.constexpr,
                   D_P: tl.constexpr, BLOCK_G: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCKS: tl.constexpr, DOT_TY: tl.constexpr, IEEE: tl.constexpr,
                   STATS: tl.constexpr, MASKED: tl.constexpr, FOLDED: tl.constexpr):
    """Program (group g of BLOCKS slot blocks, kv head kvh), numbered g * n_kv + kvh, of sequence
    ``tl.program_id(1)`` of a batch (its query, slot row and n_valid at the given strides; its scores and stats
    after the sequences' before it): for each block b of
    the group, out[h, t] = scale * <q[h], K[slots[t], kvh]> for the group's heads h (out's rows ``stride_out`` apart),
    and with STATS m[h, b] = max_t out[h, t], l[h, b] = sum_t exp(out[h, t] - m) (out's rows then padded to whole
    blocks, so that the vote loads whole blocks without a column mask; the padding is not written, the vote masks
    those columns in its result: storing them took the kernel from 96 to 108 registers a thread compiled for sm_90,
    a program fewer an SM, and a 1M decode step's scoring from 340 to 374 us a layer on an H200). The loop
    over the blocks lets the compiler fetch the next block's keys while this one is scored. MASKED: only the first
    ``*n_valid_ptr`` slots are live; the others are not read and score -inf in a block with live slots,
    and blocks without any are skipped (their scores, m and l are not written: with none live, the
    kernel does nothing). FOLDED: the tile's rows are the query groups of ``fold`` sequences (a program_id(1) of 0)
    that share the slot list, which is then read once for all: row r is head kvh * G + r % G of sequence r // G
    (queries [fold, n_heads, D] contiguous), live up to that sequence's n_valid. (A runtime count: a chunk's last
    groups, 1 to 4 of them, would otherwise each compile a kernel of their own on first use.)"""
    wait_for_inputs()
    group_id, kvh = tl.program_id(0) // n_kv, tl.program_id(0) % n_kv
    seq = tl.program_id(1).to(tl.int64)
    q_ptr += seq * stride_qb
    slot_ptr += seq * stride_slot_row
    if MASKED:
        n_valid_ptr += seq * stride_valid
    out_ptr += seq * G * n_kv * stride_out
    if STATS:
        m_ptr += seq * G * n_kv * n_blocks
        l_ptr += seq * G * n_kv * n_blocks
    rows = tl.arange(0, BLOCK_G)
    dims = tl.arange(0, D_P)  # D padded to a power of two
    row_ok, dim_ok = rows < G, dims < D
    heads = kvh * G + rows
    if FOLDED:  # heads numbered across the sequences, as the queries, scores and stats lie
        row_ok = rows < G * fold
        heads = (rows // G) * (G * n_kv) + kvh * G + rows % G
    n_live = N
    last = n_blocks
    if MASKED:
        if FOLDED:  # the slots are read up to the longest live row
            row_live = tl.minimum(tl.load(n_valid_ptr + (rows // G) * stride_valid, mask=row_ok, other=0).to(tl.int32),
                                  N)
            n_live = tl.max(row_live, axis=0)
        else:
            n_live = tl.minimum(tl.load(n_valid_ptr).to(tl.int32), N)
        last = tl.cdiv(n_live, BLOCK_N)
    if group_id * BLOCKS < last:  # (a program past the live blocks reads nothing, not even the query)
        q = as_dot_type(tl.load(q_ptr + heads[:, None] * D + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :],
                                other=0.0), DOT_TY)
        for b in range(group_id * BLOCKS, tl.minimum(group_id * BLOCKS + BLOCKS, last)):
            cols = b * BLOCK_N + tl.arange(0, BLOCK_N)
            col_ok, live = cols < N, cols < n_live
            slots = tl.load(slot_ptr + cols, mask=live, other=0).to(tl.int64)
            k = tl.load(k_ptr + slots[None, :] * stride_slot + kvh * stride_kvh + dims[:, None],
                        mask=dim_ok[:, None] & live[None, :], other=0.0)
            s = mma(q, k.to(DOT_TY), IEEE) * scale  # [BLOCK_G, BLOCK_N]
            if MASKED:
                if FOLDED:
                    s = tl.where(cols[None, :] < row_live[:, None], s, float("-inf"))
                else:
                    s = tl.where(live[None, :], s, float("-inf"))
            tl.store(out_ptr + heads[:, None].to(tl.int64) * stride_out + cols[None, :], s,
                     mask=row_ok[:, None] & col_ok[None, :])
            if STATS:
                s = tl.where(live[None, :], s, float("-inf"))
                m = tl.max(s, axis=1)
                l = tl.sum(exp_ftz(s - tl.where(m == float("-inf"), 0.0, m)[:, None]), axis=1)
                tl.store(m_ptr + heads * n_blocks + b, m, mask=row_ok)
                tl.store(l_ptr + heads * n_blocks + b, l, mask=row_ok)


# (keys per block, warps, blocks per program, pipeline stages) at head_dim <= 128, half the keys at 256. Blocks of
# 64 keys on one warp: the kernel is bound by the keys it has in flight, and 12 such programs fit an SM (154
# registers, 17 KB of shared memory) where 5 of 128 keys on 4 warps did. In a graph of layers at 1M random slots on
# an H200 they ran 1.13x over fp8 keys, 1.00x at 128K and over bf16 keys (results/supporting/scores_tiles_graph_h200.md);
# in a 1M decode step the scoring took 312 us a layer against 374, the step 20.77 ms against 22.49
# (results/supporting/scores_tile_1m_h200.md). That is a decode step's tile of 16 query rows; a folded tile of more
# rows (a prefill chunk's groups of queries: 32 for Qwen2.5's 7 heads a kv head in 4 groups) runs a warp for each 16,
# the keys' block unchanged: on one warp 64 rows spilled 336 bytes a thread (compiled for sm_90), on four they take
# 126 registers. fp32 products run on CUDA cores with fp32 operands: smaller blocks keep ptxas from spilling
# kilobytes a thread at 64 query rows.
SCORES_TILE, FP32_SCORES_TILE = (64, 1, 8, 3), (64, 8, 4, 2)


def scores_tile(block_g: int, ieee: bool) -> tuple[int, int, int, int]:
    """The tile a launch over ``block_g`` query rows (a power of two, at least 16) runs: (keys per block at head_dim
    <= 128, warps, blocks per program, stages); a warp for each 16 rows but with fp32 products."""
    block_n, warps, blocks, stages = FP32_SCORES_TILE if ieee else SCORES_TILE
    return block_n, warps if ieee else max(warps, block_g // 16), blocks, stages


def scores_block(q: torch.Tensor, k_pool: torch.Tensor) -> int:
    """The slots per block of the scores kernel (the stats' column unit) for these operands."""
    block_n = (FP32_SCORES_TILE if torch.float32 in (q.dtype, k_pool.dtype) else SCORES_TILE)[0]
    return block_n if q.shape[-1] <= 128 else block_n // 2


def scores_with_stats(q: torch.Tensor, k_pool: torch.Tensor, slots: torch.Tensor, scale: float, stats: bool,
                      n_valid: torch.Tensor | None = None):
    """Launch the scores kernel. Returns (scores [n_heads, N] fp32, m, l [n_heads, n_blocks] fp32 or None); with
    stats the scores' rows are views of rows padded to whole blocks (``scores_block``), the padding unwritten.
    n_valid: None, or an int64 tensor [] on q's device: only slots[:n_valid] are live; scores and stats
    of the blocks past them are left unwritten (see the kernel).
    A batch in one launch: q [B, n_heads, d], slots [B, N] and n_valid [B] (views of any row stride) -> scores
    [B, n_heads, N], m, l [B, n_heads, n_blocks]. A batch whose sequences share one slot list (slots [N], or rows at
    stride 0: a prefill chunk's groups of queries) is folded into the tile's query rows where they fit
    (MAX_GROUP_ROWS), so that each key is read once for the batch."""
    batched = q.dim() == 3
    qs = q if batched else q[None]
    batch, n_heads, d = qs.shape
    slot_rows = slots if slots.dim() == 2 else slots[None]  # one list for every sequence: read at row stride 0
    if slot_rows.shape[0] not in (1, batch):
        raise ValueError(f"{slot_rows.shape[0]} slot lists for {batch} queries")
    slot_rows = rows_in_place(slot_rows)
    n_kv, n = k_pool.shape[1], slot_rows.shape[1]
    group = n_heads // n_kv
    shared = slot_rows.shape[0] == 1 or slot_rows.stride(0) == 0
    fold = batch if batch > 1 and shared and batch * group <= MAX_GROUP_ROWS else 1
    if not (qs.is_contiguous() if fold > 1 else qs[0].is_contiguous()):
        qs = qs.contiguous()
    dot_ty, ieee = exact_dot_type(q.dtype, k_pool.dtype)
    block_g = max(16, triton.next_power_of_2(group * fold))
    _, warps, blocks, stages = scores_tile(block_g, ieee)
    block_n = scores_block(qs[0], k_pool)
    n_blocks = triton.cdiv(n, block_n)
    width = n_blocks * block_n if stats else n  # with stats, rows padded to whole blocks (see the kernel)
    out = torch.empty(batch, n_heads, width, dtype=torch.float32, device=q.device)
    m = torch.empty(batch, n_heads, n_blocks, dtype=torch.float32, device=q.device) if stats else None
    l = torch.empty_like(m) if stats else None
    valid = None if n_valid is None else n_valid.reshape(-1)
    if n and batch:
        _scores_kernel[(triton.cdiv(n_blocks, blocks) * n_kv, batch // fold)](
            qs, k_pool, slot_rows, out, m, l, valid, n, group, n_kv, n_blocks, float(scale),
            k_pool.stride(0), k_pool.stride(1), qs.stride(0), 0 if shared else slot_rows.stride(0),
            0 if valid is None else valid.stride(0), fold, width, D=d, D_P=max(16, triton.next_power_of_2(d)),
            BLOCK_G=block_g, BLOCK_N=block_n, BLOCKS=blocks,
            DOT_TY=dot_ty, IEEE=ieee, STATS=stats, MASKED=n_valid is not None, FOLDED=fold > 1, num_warps=warps,
            num_stages=stages, launch_pdl=dependent(out))
    out = out[..., :n]
    if batched:
        return out, m, l
    return out[0], None if m is None else m[0], None if l is None else l[0]


MAX_GROUP_ROWS = 64  # query rows per kv head in one launch: more would overflow shared memory


def paged_dot(q: torch.Tensor, k_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """Triton version of :func:`paged_dot_ref` (same arguments, same result up to rounding).

    Policies that score a whole chunk pass many rows per kv head (n_heads * chunk rows, head-major);
    those go through the kernel in slices of at most MAX_GROUP_ROWS rows per kv head."""
    n_kv, group = k_pool.shape[1], q.shape[0] // k_pool.shape[1]
    if group <= MAX_GROUP_ROWS:
        return scores_with_stats(q, k_pool, slots, 1.0, stats=False)[0]
    by_kv = q.view(n_kv, group, q.shape[1])
    out = torch.empty(n_kv, group, slots.numel(), dtype=torch.float32, device=q.device)
    for start in range(0, group, MAX_GROUP_ROWS):
        part = by_kv[:, start:start + MAX_GROUP_ROWS]
        scores = scores_with_stats(part.reshape(-1, q.shape[1]), k_pool, slots, 1.0, stats=False)[0]
        out[:, start:start + MAX_GROUP_ROWS] = scores.view(n_kv, part.shape[1], -1)
    return out.view(q.shape[0], -1)

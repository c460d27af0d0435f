"""Sparse paged attention: a chunk of queries attends to a list of cache slots, with RoPE applied
on the fly at the positions the policy chose.

The slot list holds the context first and the chunk's own tokens last (their K/V are already in the
cache), so causality is "bottom-right aligned": key j is visible to query i iff j <= i + n - c. A
graph's list may be longer than what it attends: with ``n_valid`` (a device scalar) n is that live
length, read on the device, and the entries after it are not read.
Query head h reads kv head h // (n_heads // n_kv_heads).

The Triton kernel reads values in place (no gather) and runs a flash-style online softmax with
both products on tensor cores: RoPE is applied in fp32, then q, the keys and the probabilities are
cast to the query's dtype (bf16/fp16) for the two ``tl.dot``s, which accumulate in fp32, as flash
attention does; fp32 inputs keep fp32 (IEEE) products. fp8 pools are upcast on load.

Keys are rotated where it is cheapest. A decode step (one row block per kv head) rotates each key
in the attention kernel itself, once. A chunk has many row blocks per kv head that all read the same
keys, so a small kernel first rotates the list's keys once into a [n, n_kv, d] buffer in the dot's
dtype (rounding them exactly as the in-kernel cast would), and the attention kernel reads that.

The key list is split across programs (split-K, "flash decoding") when there are too few row
blocks to fill the GPU, as for a single decode query; a second small kernel then merges the
partial results by their log-sum-exp. With one split the attention kernel writes the output itself.

On a Hopper GPU cuDNN's attention runs a chunk's products at 625 TFLOP/s where this kernel's tile reaches about 285
(results/supporting/chunk_attention_paths_h200.md), so with a ``cudnn`` budget a chunk of a multiple of 64
queries over a whole list gathers its rotated keys and its values into buffers and runs cuDNN on them
(``_chunk_by_cudnn``): 1.5x this kernel over TokenSelect's four groups of 512 queries, 1.3x over one 512-query chunk
(results/supporting/chunk_attention_rotate_heads_h200.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ..rope import rotate
from .cudnn_attention import PlanBudget, chunk_by_cudnn
from .dot import INTERPRETED, mma, query_dot_type
from .launch import dependent, wait_for_inputs
from .operands import rows_in_place
from .splits import key_splits, live_keys_per_split

LOG2E = 1.4426950408889634


def sparse_attention_ref(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                         key_pos: torch.Tensor, q_pos: torch.Tensor, inv_freq: torch.Tensor, rope_scale: float = 1.0,
                         sm_scale: float | None = None, n_valid: torch.Tensor | None = None) -> torch.Tensor:
    """q: [c, n_heads, d] un-rotated; k_pool, v_pool: [n_slots, n_kv_heads, d]; slots, key_pos: [n];
    q_pos: [c]; inv_freq: [d // 2] fp32; n_valid: None, or int64 [] on q's device: only the list's first
    n_valid entries are attended (the chunk's own tokens are the last c of those), as a graph whose list
    is a table of fixed length needs (masked, not sliced: no host read). Returns [c, n_heads, d] in q's dtype.

    A batch of B sequences in one call: q [B, c, n_heads, d], slots [B, n], q_pos [B, c], n_valid None or [B];
    key_pos [n] (shared) or [B, n], inv_freq [d // 2] (shared) or [B, d // 2] -> [B, c, n_heads, d], each
    sequence as alone."""
    if q.dim() == 4:
        def row(x, b):  # a shared operand, or the sequence's row of a batched one
            return x if x.dim() == 1 else x[b]
        return torch.stack([sparse_attention_ref(q[b], k_pool, v_pool, slots[b], row(key_pos, b), q_pos[b],
                                                 row(inv_freq, b), rope_scale, sm_scale,
                                                 None if n_valid is None else n_valid[b]) for b in range(q.shape[0])])
    c, n = q.shape[0], slots.shape[0]
    k = rotate(k_pool[slots].to(q.dtype), key_pos, inv_freq, rope_scale)  # [n, n_kv, d]; fp8 pools upcast
    v = v_pool[slots].to(q.dtype)
    live = n if n_valid is None else n_valid
    cols = torch.arange(n, device=q.device)
    if n_valid is not None:  # rows past the live prefix may hold anything: zero them (0 x NaN would be NaN)
        k, v = (torch.where((cols < live)[:, None, None], x, 0) for x in (k, v))
    qr = rotate(q, q_pos, inv_freq, rope_scale)
    visible = cols[None, :] <= torch.arange(c, device=q.device)[:, None] + (live - c)
    out = F.scaled_dot_product_attention(
        qr.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=visible, scale=sm_scale, enable_gqa=k.shape[1] != q.shape[1],
    )
    return out.transpose(0, 1)


# 2 pi = TWO_PI_HI + TWO_PI_LO + 7e-15, HI the nearest fp32
TWO_PI_HI, TWO_PI_LO, INV_TWO_PI = tl.constexpr(6.2831854820251465), tl.constexpr(-1.7484555314695172e-07), \
    tl.constexpr(0.15915494309189535)


@triton.jit
def _cos_sin(angle):
    """cos and sin of fp32 angles of any size (pos * inv_freq reaches ~1M rad at 1M tokens). On the GPU
    the angle is first reduced to about [-pi, pi] (whole turns taken off by two fused multiply-adds, exact
    to ~5e-7 rad), where the hardware's one-instruction sin/cos are accurate to ~1e-6: libdevice's
    accurate ones cost tens of instructions each, and a slow path above 105,615 rad, for every key of a
    decode step. The CPU interpreter (whose fma rounds twice) takes numpy's."""
    if INTERPRETED:
        return tl.cos(angle), tl.sin(angle)
    else:
        turns = tl.floor(angle * INV_TWO_PI + 0.5)
        r = tl.fma(turns, -TWO_PI_HI, angle)
        r = tl.fma(turns, -TWO_PI_LO, r)
        return libdevice.fast_cosf(r), libdevice.fast_sinf(r)


@triton.jit
def _rope_halves(x1, x2, pos, inv_freq, rope_scale):
    """Rotate-half RoPE of a row block given as its two halves [R, d/2] at positions [R] (fp32)."""
    cos, sin = _cos_sin(pos[:, None] * inv_freq[None, :])
    cos, sin = cos * rope_scale, sin * rope_scale
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _rotate_keys_kernel(k_ptr, slot_ptr, kpos_ptr, inv_freq_ptr, out_ptr, n_valid_ptr, N, n_kv, rope_scale,
                        k_stride_slot, k_stride_kvh, slot_stride_b, kpos_stride_b, inv_stride_b, k_stride_b,
                        v_ptr, v_out_ptr, v_stride_slot, v_stride_kvh,
                        HALF: tl.constexpr, HALF_P: tl.constexpr, BLOCK_N: tl.constexpr, LIVE: tl.constexpr,
                        DIRECT: tl.constexpr, GATHER_V: tl.constexpr):
    """Program = a block of list entries j of sequence b (axis 1) for kv head kvh (axis 2): out[b, j, kvh] =
    RoPE(k_pool[slots[b, j], kvh], key_pos[b, j]) in out's dtype. A head a program because a loop over the heads in
    one program issues their loads one after another, a chain of n_kv memory latencies (32 for a chunk's queries);
    the angles cost a few instructions an element against its bytes, so each head's program computes its own.
    LIVE: only the first ``n_valid[b]`` entries (the others are neither read nor written). DIRECT: the rows are
    b's own, row j at ``k_ptr + b * k_stride_b + j * k_stride_slot`` (no slot list: a chunk's queries). GATHER_V:
    also v_out[b, j, kvh] = v_pool[slots[b, j], kvh] in v_out's dtype (the values read in the same pass)."""
    wait_for_inputs()
    b = tl.program_id(1).to(tl.int64)
    slot_ptr += b * slot_stride_b
    kpos_ptr += b * kpos_stride_b
    inv_freq_ptr += b * inv_stride_b
    k_ptr += b * k_stride_b
    out_ptr += b * N * n_kv * (2 * HALF)
    if GATHER_V:
        v_out_ptr += b * N * n_kv * (2 * HALF)
    if LIVE:
        N = tl.minimum(tl.load(n_valid_ptr + b).to(tl.int32), N)
    j = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.arange(0, HALF_P)
    j_ok, dim_ok = j < N, half < HALF
    ok = j_ok[:, None] & dim_ok[None, :]
    if DIRECT:
        slot = j.to(tl.int64)
    else:
        slot = tl.load(slot_ptr + j, mask=j_ok, other=0).to(tl.int64)
    cos, sin = _cos_sin(tl.load(kpos_ptr + j, mask=j_ok, other=0).to(tl.float32)[:, None] *
                        tl.load(inv_freq_ptr + half, mask=dim_ok, other=0.0)[None, :])
    cos, sin = cos * rope_scale, sin * rope_scale
    kvh = tl.program_id(2).to(tl.int64)
    k_base = k_ptr + slot[:, None] * k_stride_slot + kvh * k_stride_kvh + half[None, :]
    k1 = tl.load(k_base, mask=ok, other=0.0).to(tl.float32)
    k2 = tl.load(k_base + HALF, mask=ok, other=0.0).to(tl.float32)
    out_base = out_ptr + (j.to(tl.int64) * n_kv + kvh)[:, None] * (2 * HALF) + half[None, :]
    tl.store(out_base, (k1 * cos - k2 * sin).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out_base + HALF, (k2 * cos + k1 * sin).to(out_ptr.dtype.element_ty), mask=ok)
    if GATHER_V:
        v_base = v_ptr + slot[:, None] * v_stride_slot + kvh * v_stride_kvh + half[None, :]
        v_out = v_out_ptr + (j.to(tl.int64) * n_kv + kvh)[:, None] * (2 * HALF) + half[None, :]
        tl.store(v_out, tl.load(v_base, mask=ok, other=0.0).to(v_out_ptr.dtype.element_ty), mask=ok)
        tl.store(v_out + HALF, tl.load(v_base + HALF, mask=ok, other=0.0).to(v_out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _attend_block(q1, q2, m, l, acc, start, hi, i, N, C, kvh, k_ptr, v_ptr, slot_ptr, kpos_ptr, inv_freq, rope_scale,
                  k_stride_row, k_stride_kvh, v_stride_slot, v_stride_kvh, half, dims, dim_ok, v_dim_ok,
                  HALF: tl.constexpr, BLOCK_N: tl.constexpr, DOT_TY: tl.constexpr, IEEE: tl.constexpr,
                  ROTATED: tl.constexpr, MASKED: tl.constexpr):
    """Keys [start, start + BLOCK_N) of the list into the online softmax of the rows (query indices i):
    returns the new (m, l, acc). Unless MASKED, every key of the block is < hi and visible to every row."""
    j = start + tl.arange(0, BLOCK_N)
    if MASKED:
        col_ok = j < hi
    else:
        col_ok = tl.full((BLOCK_N,), 1, tl.int1)
    slot = tl.load(slot_ptr + j, mask=col_ok, other=0).to(tl.int64)
    if ROTATED:
        k_base = k_ptr + j.to(tl.int64)[:, None] * k_stride_row + kvh * k_stride_kvh
    else:
        k_base = k_ptr + slot[:, None] * k_stride_row + kvh * k_stride_kvh
    k_ok = col_ok[:, None] & dim_ok[None, :]
    k1 = tl.load(k_base + half[None, :], mask=k_ok, other=0.0)
    k2 = tl.load(k_base + HALF + half[None, :], mask=k_ok, other=0.0)
    if not ROTATED:
        k_pos = tl.load(kpos_ptr + j, mask=col_ok, other=0).to(tl.float32)
        k1, k2 = _rope_halves(k1.to(tl.float32), k2.to(tl.float32), k_pos, inv_freq, rope_scale)
    s = mma(q1, tl.trans(k1.to(DOT_TY)), IEEE) + mma(q2, tl.trans(k2.to(DOT_TY)), IEEE)
    if MASKED:
        s = tl.where(col_ok[None, :] & (j[None, :] <= i[:, None] + N - C), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet
    else:
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = m_new
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    v = tl.load(v_ptr + slot[:, None] * v_stride_slot + kvh * v_stride_kvh + dims[None, :],
                mask=col_ok[:, None] & v_dim_ok[None, :], other=0.0)
    return m_new, l * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + mma(p.to(DOT_TY), v.to(DOT_TY), IEEE)


@triton.jit
def _sparse_attention_kernel(
    q_ptr, k_ptr, v_ptr, slot_ptr, kpos_ptr, qpos_ptr, inv_freq_ptr, out_ptr, m_ptr, l_ptr, n_valid_ptr,
    C, N, G, H, keys_per_split, rope_scale, qk_scale, k_stride_row, k_stride_kvh, v_stride_slot, v_stride_kvh,
    row_blocks, slot_stride_b, kpos_stride_b, inv_stride_b, k_stride_b, q_stride_tok, qpos_stride_b,
    HALF: tl.constexpr, HALF_P: tl.constexpr, D_P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_TY: tl.constexpr, IEEE: tl.constexpr, ROTATED: tl.constexpr, SPLIT: tl.constexpr, LIVE: tl.constexpr,
):
    """One program: a block of (query, head-of-group) rows of kv head ``kvh`` over one split of the
    key list. Keys come from the pool at ``slots[j]`` and are rotated here, or (ROTATED) from row j
    of the pre-rotated buffer. Scores are in log2 units (``qk_scale`` = sm_scale * log2 e). Key
    blocks that every row sees in full skip the masks; the rest (the causal edge, the split's
    ragged end) are masked. SPLIT: writes the unnormalised acc [R, d], the running max m and sum l
    for the merge; otherwise the normalised output in out's dtype. LIVE: the list is its first
    ``*n_valid_ptr`` entries (read on the device), spread over the splits here (the grid was planned for
    the whole list); a split past them sees no key (m = -inf, l = 0).
    A batch: axis 0 runs over (sequence b, row block); b's queries, lists, positions, frequencies (and rotated
    keys) start at its offsets, the pools are shared. The queries are read at their token stride (a view of the
    model's q, k, v product is not copied), a head's d values contiguous."""
    wait_for_inputs()
    b = tl.program_id(0) // row_blocks
    n_seqs = tl.num_programs(0) // row_blocks
    b64 = b.to(tl.int64)
    q_ptr += b64 * C * q_stride_tok
    slot_ptr += b64 * slot_stride_b
    kpos_ptr += b64 * kpos_stride_b
    qpos_ptr += b64 * qpos_stride_b
    inv_freq_ptr += b64 * inv_stride_b
    k_ptr += b64 * k_stride_b
    if LIVE:
        N = tl.minimum(tl.load(n_valid_ptr + b).to(tl.int32), N)
        keys_per_split = live_keys_per_split(N, BLOCK_N)
    pid_r, kvh, split = tl.program_id(0) % row_blocks, tl.program_id(1), tl.program_id(2)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < C * G
    i = r // G  # query index in the chunk
    h = kvh * G + r % G  # query head
    half = tl.arange(0, HALF_P)  # HALF padded to a power of two >= 16 (tl.dot's least K)
    dims = tl.arange(0, D_P)  # 2 * HALF padded likewise, for V and the output
    dim_ok, v_dim_ok = half < HALF, dims < 2 * HALF
    inv_freq = tl.load(inv_freq_ptr + half, mask=dim_ok, other=0.0)
    q_pos = tl.load(qpos_ptr + i, mask=row_ok, other=0).to(tl.float32)
    q_base = q_ptr + (i.to(tl.int64) * q_stride_tok + h * (2 * HALF))[:, None]
    q_ok = row_ok[:, None] & dim_ok[None, :]
    q1 = tl.load(q_base + half[None, :], mask=q_ok, other=0.0).to(tl.float32)
    q2 = tl.load(q_base + HALF + half[None, :], mask=q_ok, other=0.0).to(tl.float32)
    q1, q2 = _rope_halves(q1, q2, q_pos, inv_freq, rope_scale)
    q1 = (q1 * qk_scale).to(DOT_TY)
    q2 = (q2 * qk_scale).to(DOT_TY)

    m = tl.full((BLOCK_R,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_R,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_R, D_P), dtype=tl.float32)
    lo = split * keys_per_split
    last_row = tl.minimum(pid_r * BLOCK_R + BLOCK_R, C * G) - 1
    hi = tl.minimum(tl.minimum(lo + keys_per_split, N), last_row // G + N - C + 1)  # causal bound
    full = tl.minimum(hi, (pid_r * BLOCK_R) // G + N - C + 1)  # keys below this are visible to every row
    full = lo + tl.maximum(full - lo, 0) // BLOCK_N * BLOCK_N
    for start in range(lo, full, BLOCK_N):
        m, l, acc = _attend_block(q1, q2, m, l, acc, start, hi, i, N, C, kvh, k_ptr, v_ptr, slot_ptr, kpos_ptr,
                                  inv_freq, rope_scale, k_stride_row, k_stride_kvh, v_stride_slot, v_stride_kvh, half,
                                  dims, dim_ok, v_dim_ok, HALF, BLOCK_N, DOT_TY, IEEE, ROTATED, MASKED=False)
    for start in range(full, hi, BLOCK_N):
        m, l, acc = _attend_block(q1, q2, m, l, acc, start, hi, i, N, C, kvh, k_ptr, v_ptr, slot_ptr, kpos_ptr,
                                  inv_freq, rope_scale, k_stride_row, k_stride_kvh, v_stride_slot, v_stride_kvh, half,
                                  dims, dim_ok, v_dim_ok, HALF, BLOCK_N, DOT_TY, IEEE, ROTATED, MASKED=True)

    out_ok = row_ok[:, None] & v_dim_ok[None, :]
    if SPLIT:
        row = (split * n_seqs + b) * C * H + i * H + h  # partials laid out [split, sequence, query, head]
        tl.store(out_ptr + row[:, None].to(tl.int64) * (2 * HALF) + dims[None, :], acc, mask=out_ok)
        tl.store(m_ptr + row, m, mask=row_ok)
        tl.store(l_ptr + row, l, mask=row_ok)
    else:  # every row sees key 0, so l > 0
        out = acc / l[:, None]
        tl.store(out_ptr + ((b * C + i) * H + h)[:, None].to(tl.int64) * (2 * HALF) + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=out_ok)


@triton.jit(do_not_specialize=["rows", "splits"])
def _merge_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, rows, splits, D: tl.constexpr, D_P: tl.constexpr,
                  BLOCK_S: tl.constexpr, BLOCK_ROWS: tl.constexpr):
    """Program = a block of (query, head) rows: out = sum_s w_s acc_s / sum_s w_s l_s with
    w_s = 2^(m_s - max_s m_s). Splits that saw no visible key have m = -inf, so weight 0.
    The splits are walked BLOCK_S at a time with a running max (the sums rescaled when it grows), so that one
    compiled variant serves every split count: a count the warm-up did not meet would otherwise compile a variant
    inside a first request (0.3-0.4 s each, benchmarks/results/supporting/warm_up_past_threshold_h200.md). Each
    block's loads are one round trip, not one a split."""
    wait_for_inputs()
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    r_ok = r < rows
    r_in = tl.minimum(r, rows - 1)  # rows past the end read the last row and are not stored
    dims = tl.arange(0, D_P)  # D padded to a power of two
    dim_ok = dims < D
    m_run = tl.full((BLOCK_ROWS,), float("-inf"), dtype=tl.float32)
    num = tl.zeros((BLOCK_ROWS, D_P), dtype=tl.float32)
    den = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
    for first in range(0, splits, BLOCK_S):
        sb = first + tl.arange(0, BLOCK_S)
        idx = sb[None, :] * rows + r_in[:, None]  # [rows, splits]
        s_ok = (sb < splits)[None, :]
        m = tl.load(m_ptr + idx, mask=s_ok, other=float("-inf"))
        m_new = tl.maximum(m_run, tl.max(m, axis=1))  # split 0 sees key 0, so finite from the first block on
        rescale = tl.exp2(m_run - m_new)  # 0 while m_run is -inf
        w = tl.exp2(m - m_new[:, None])
        den = den * rescale + tl.sum(w * tl.load(l_ptr + idx, mask=s_ok, other=0.0), axis=1)
        acc = tl.load(acc_ptr + idx[:, :, None].to(tl.int64) * D + dims[None, None, :],
                      mask=s_ok[:, :, None] & dim_ok[None, None, :], other=0.0)
        num = num * rescale[:, None] + tl.sum(w[:, :, None] * acc, axis=1)
        m_run = m_new
    out = num / den[:, None]
    tl.store(out_ptr + r[:, None].to(tl.int64) * D + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=r_ok[:, None] & dim_ok[None, :])


# Tiles: (rows, keys, warps, pipeline stages) of a program, keys halved (at least 16) for head_dim > 128.
# Decode rows (one query x its group) fill a 16-row tile; a chunk gets larger tiles, so each program
# reads a key block once for rows / group queries. fp32 products run on CUDA cores and hold their
# operands in fp32, so fp32 chunks get a smaller tile (64 rows at head_dim 256 made ptxas spill
# ~14 KB a thread). H100 sweep at 1M (benchmarks/results/attention_h100.md): 64/128 rows, 32-128 keys,
# 4/8 warps, 2-4 stages for chunks. Decode, swept at 2K/32K/128K keys with 264-792 programs
# (benchmarks/results/supporting/decode_attention_h100.md): 64 keys, 2 stages, 396 programs; fp32 decode keeps
# the earlier 16 keys, 3 stages (64 keys would spill ~1 KB a thread at head_dim 128, ~7 KB at 256).
DECODE_TILE, FP32_DECODE_TILE = (16, 64, 4, 2), (16, 16, 4, 3)
CHUNK_TILE, FP32_CHUNK_TILE = (64, 64, 4, 3), (32, 32, 4, 2)
TARGET_PROGRAMS = 396  # decode split-K: programs to aim for (3 per SM of an H100)
ROTATE_BLOCK = 32  # list entries per program (of one kv head) of the key-rotation kernel
QUERY_ROTATE_BLOCK = 32  # queries per program (of one head) where cuDNN's path rotates them
# chunk lengths the cuDNN path takes: PyTorch builds (~60 ms on the host) and caches a cuDNN plan for each shape, so
# a prompt's ragged last chunk, whose length is any, would build one for a single use; it takes the Triton kernel
CUDNN_GRAIN = 64
MERGE_TILE = 8192  # elements of a merge program's (rows x splits x d) tile of partial outputs
# splits a merge program reads at a time, at most: a decode step over 8 kv heads has up to 49 (TARGET_PROGRAMS / 8),
# so one block. Fewer at a time take several blocks one after another, in fewer programs: 16 cost one query 2.5 us a
# layer on an H200 (benchmarks/results/supporting/warm_up_merge_h200.md)
MERGE_SPLITS = 64


def padded_half(d: int) -> int:
    """d / 2 padded to the power of two (at least 16) the kernels' tiles of a RoPE half take."""
    return max(16, triton.next_power_of_2(d // 2))


def merge_tile(d_p: int) -> tuple[int, int]:
    """(splits read at a time, (query, head) rows) of a merge program at a padded head_dim of d_p: its tile of
    partial outputs within MERGE_TILE elements, each row's splits in as few blocks as that allows."""
    block_s = max(1, min(MERGE_SPLITS, MERGE_TILE // d_p))
    return block_s, max(1, min(16, MERGE_TILE // (block_s * d_p)))


def list_strides(slots: torch.Tensor, key_pos: torch.Tensor, inv_freq: torch.Tensor) -> tuple[int, int, int]:
    """Each sequence's step in slots [B, n], key_pos and inv_freq (0 where one row is shared by every sequence)."""
    return (slots.stride(0), key_pos.stride(0) if key_pos.dim() == 2 else 0,
            inv_freq.stride(0) if inv_freq.dim() == 2 else 0)


def sparse_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                     key_pos: torch.Tensor, q_pos: torch.Tensor, inv_freq: torch.Tensor, rope_scale: float = 1.0,
                     sm_scale: float | None = None, n_valid: torch.Tensor | None = None,
                     cudnn: PlanBudget | None = None) -> torch.Tensor:
    """Triton version of :func:`sparse_attention_ref` (same arguments, same result up to rounding), a batch of
    sequences in one launch of each kernel. With ``n_valid`` the grid is planned for all n entries; the kernels
    read the live length on the device and share it out among the splits. A batched operand may be any [B, n]
    view whose rows are contiguous (a slot table's rows; a shared list expanded, stride 0).

    With ``cudnn`` (CUDA, bf16/fp16 queries) a chunk of a multiple of CUDNN_GRAIN queries over a whole list (no
    ``n_valid``), of a shape the budget admits, runs as ``_chunk_by_cudnn``; everything else as above."""
    if q.dim() == 3:  # one sequence: a batch of one
        return sparse_attention(q[None], k_pool, v_pool, slots[None], key_pos, q_pos[None], inv_freq, rope_scale,
                                sm_scale, None if n_valid is None else n_valid.view(1), cudnn)[0]
    batch, c, n_heads, d = q.shape
    n_kv, n = k_pool.shape[1], slots.shape[1]
    group = n_heads // n_kv
    sm_scale = d ** -0.5 if sm_scale is None else sm_scale
    dot_ty, ieee = query_dot_type(q.dtype, k_pool.dtype)
    half_p, d_p = padded_half(d), max(16, triton.next_power_of_2(d))
    if c * group <= DECODE_TILE[0]:  # one row block per kv head
        tile = FP32_DECODE_TILE if ieee else DECODE_TILE
    else:
        tile = FP32_CHUNK_TILE if ieee else CHUNK_TILE
    block_r, block_n, warps, stages = tile
    block_n = block_n if d <= 128 else max(16, block_n // 2)
    row_blocks = triton.cdiv(c * group, block_r)
    splits, keys_per_split = key_splits(n, block_n, TARGET_PROGRAMS // (batch * row_blocks * n_kv))
    # read in place where the strides allow: rows of contiguous entries (a slot table's rows, a shared arange at
    # stride 0), queries at any token stride (a view of the model's q, k, v product)
    slots, key_pos, q_pos = (rows_in_place(x) for x in (slots, key_pos, q_pos))
    n_valid = None if n_valid is None else n_valid.contiguous()
    inv_freq = rows_in_place(inv_freq.to(device=q.device, dtype=torch.float32))
    stride_tok = q.stride(1) if c > 1 else q.stride(0)  # a size-1 dimension's stride says nothing
    if q.stride(3) != 1 or q.stride(2) != d or batch > 1 and q.stride(0) != c * stride_tok:
        q = q.contiguous()
        stride_tok = q.stride(1)
    if (cudnn is not None and n_valid is None and not ieee and c % CUDNN_GRAIN == 0
            and cudnn.admits((batch, c, n, n_heads, n_kv, d, q.dtype))):
        return _chunk_by_cudnn(q, k_pool, v_pool, slots, key_pos, q_pos, inv_freq, float(rope_scale), float(sm_scale),
                               stride_tok)
    strides, pdl = list_strides(slots, key_pos, inv_freq), dependent(q)  # up to three launches
    rotated = row_blocks > 1
    if rotated:  # rotate each key once instead of once per row block
        keys = torch.empty(batch, n, n_kv, d, dtype=torch.float32 if ieee else q.dtype, device=q.device)
        _rotate_keys_kernel[(triton.cdiv(n, ROTATE_BLOCK), batch, n_kv)](
            k_pool, slots, key_pos, inv_freq, keys, n_valid, n, n_kv, float(rope_scale), k_pool.stride(0),
            k_pool.stride(1), *strides, 0, None, None, 0, 0, HALF=d // 2, HALF_P=half_p, BLOCK_N=ROTATE_BLOCK,
            LIVE=n_valid is not None, DIRECT=False, GATHER_V=False, launch_pdl=pdl)
        k_stride_row, k_stride_kvh, k_stride_b = keys.stride(1), keys.stride(2), keys.stride(0)
    else:
        keys, k_stride_row, k_stride_kvh, k_stride_b = k_pool, k_pool.stride(0), k_pool.stride(1), 0
    out = torch.empty(batch, c, n_heads, d, dtype=q.dtype, device=q.device)
    split = splits > 1
    if split:  # partial results for the merge
        acc = torch.empty(splits, batch, c, n_heads, d, dtype=torch.float32, device=q.device)
        m = torch.empty(splits, batch, c, n_heads, dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
    _sparse_attention_kernel[(batch * row_blocks, n_kv, splits)](
        q, keys, v_pool, slots, key_pos, q_pos, inv_freq, *((acc, m, l) if split else (out, None, None)),
        n_valid, c, n, group, n_heads, keys_per_split, float(rope_scale), float(sm_scale) * LOG2E,
        k_stride_row, k_stride_kvh, v_pool.stride(0), v_pool.stride(1), row_blocks, *strides, k_stride_b,
        stride_tok, q_pos.stride(0),
        HALF=d // 2, HALF_P=half_p, D_P=d_p, BLOCK_R=block_r, BLOCK_N=block_n, DOT_TY=dot_ty, IEEE=ieee,
        ROTATED=rotated, SPLIT=split, LIVE=n_valid is not None, num_warps=warps, num_stages=stages,
        launch_pdl=pdl)
    if split:
        rows, (block_s, block_rows) = batch * c * n_heads, merge_tile(d_p)
        _merge_kernel[(triton.cdiv(rows, block_rows),)](acc, m, l, out, rows, splits, D=d, D_P=d_p,
                                                         BLOCK_S=block_s, BLOCK_ROWS=block_rows, launch_pdl=pdl)
    return out


def cudnn_operands(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                   key_pos: torch.Tensor, q_pos: torch.Tensor, inv_freq: torch.Tensor, rope_scale: float = 1.0,
                   stride_tok: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the cuDNN path attends: the list's keys rotated and its values gathered into [B, n, n_kv, d] buffers
    in one pass, the queries rotated into [B, c, H, d] (both by ``_rotate_keys_kernel``, so keys round as the Triton
    path's do). q [B, c, H, d] (its sequences ``c * stride_tok`` apart, default contiguous); slots, q_pos [B, *]
    and key_pos, inv_freq [*] or [B, *] read in place (rows of contiguous entries, inv_freq fp32) -> (queries,
    keys, values)."""
    batch, c, n_heads, d = q.shape
    n, n_kv = slots.shape[1], k_pool.shape[1]
    half_p = padded_half(d)
    stride_tok = q.stride(1) if stride_tok is None else stride_tok
    strides, pdl = list_strides(slots, key_pos, inv_freq), dependent(q)
    keys = torch.empty(batch, n, n_kv, d, dtype=q.dtype, device=q.device)
    values = torch.empty_like(keys)
    _rotate_keys_kernel[(triton.cdiv(n, ROTATE_BLOCK), batch, n_kv)](
        k_pool, slots, key_pos, inv_freq, keys, None, n, n_kv, float(rope_scale), k_pool.stride(0),
        k_pool.stride(1), *strides, 0, v_pool, values, v_pool.stride(0), v_pool.stride(1), HALF=d // 2,
        HALF_P=half_p, BLOCK_N=ROTATE_BLOCK, LIVE=False, DIRECT=False, GATHER_V=True, launch_pdl=pdl)
    queries = torch.empty(batch, c, n_heads, d, dtype=q.dtype, device=q.device)
    _rotate_keys_kernel[(triton.cdiv(c, QUERY_ROTATE_BLOCK), batch, n_heads)](
        q, q_pos, q_pos, inv_freq, queries, None, c, n_heads, float(rope_scale), stride_tok, d, 0, q_pos.stride(0),
        strides[2], c * stride_tok, None, None, 0, 0, HALF=d // 2, HALF_P=half_p, BLOCK_N=QUERY_ROTATE_BLOCK,
        LIVE=False, DIRECT=True, GATHER_V=False, launch_pdl=pdl)
    return queries, keys, values


def _chunk_by_cudnn(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
                    key_pos: torch.Tensor, q_pos: torch.Tensor, inv_freq: torch.Tensor, rope_scale: float,
                    sm_scale: float, stride_tok: int) -> torch.Tensor:
    """A batch of chunks by cuDNN's attention (``kernels.cudnn_attention``): ``cudnn_operands``, then the context
    and the chunk's own keys as two cuDNN calls merged by their log-sum-exps. Operands as ``sparse_attention`` has
    prepared them -> [B, c, H, d]."""
    queries, keys, values = cudnn_operands(q, k_pool, v_pool, slots, key_pos, q_pos, inv_freq, rope_scale, stride_tok)
    out = torch.empty_like(queries)
    chunk_by_cudnn(queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), sm_scale,
                   out=out.transpose(1, 2))
    return out

"""Sparse paged attention: a chunk of queries attends to a list of cache slots, with RoPE applied
on the fly at the positions the policy chose.

The slot list holds the context first and the chunk's own tokens last (their K/V are already in the
cache), so causality is "bottom-right aligned": key j is visible to query i iff j <= i + n - c.
Query head h reads kv head h // (n_heads // n_kv_heads).

The Triton kernel reads keys and values in place (no gather), rotates q and each key block in
registers, and runs a flash-style online softmax. The key list is split across programs
(split-K, "flash decoding") so that a single decode query still spreads over the whole GPU;
a second small kernel merges the partial results by their log-sum-exp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..rope import rotate
from .paged_dot import dot_fp32


def sparse_attention_ref(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    key_pos: torch.Tensor,
    q_pos: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_scale: float = 1.0,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """q: [c, n_heads, d] un-rotated; k_pool, v_pool: [n_slots, n_kv_heads, d]; slots, key_pos: [n];
    q_pos: [c]; inv_freq: [d // 2] fp32. Returns [c, n_heads, d] in q's dtype."""
    c, n = q.shape[0], slots.shape[0]
    k = rotate(k_pool[slots].to(q.dtype), key_pos, inv_freq, rope_scale)  # [n, n_kv, d]; fp8 pools upcast
    v = v_pool[slots].to(q.dtype)
    qr = rotate(q, q_pos, inv_freq, rope_scale)
    visible = torch.arange(n, device=q.device)[None, :] <= torch.arange(c, device=q.device)[:, None] + (n - c)
    out = F.scaled_dot_product_attention(
        qr.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
        attn_mask=visible, scale=sm_scale, enable_gqa=k.shape[1] != q.shape[1],
    )
    return out.transpose(0, 1)


@triton.jit
def _rope_halves(x1, x2, pos, inv_freq, rope_scale):
    """Rotate-half RoPE of a row block given as its two halves [R, d/2] at positions [R] (fp32)."""
    angle = pos[:, None] * inv_freq[None, :]
    cos = tl.cos(angle) * rope_scale
    sin = tl.sin(angle) * rope_scale
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _sparse_attention_kernel(
    q_ptr, k_ptr, v_ptr, slot_ptr, kpos_ptr, qpos_ptr, inv_freq_ptr, acc_ptr, m_ptr, l_ptr,
    C, N, G, H, keys_per_split, rope_scale, sm_scale, k_stride_slot, k_stride_kvh, v_stride_slot, v_stride_kvh,
    HALF: tl.constexpr, HALF_P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    """One program: a block of (query, head-of-group) rows of kv head ``kvh`` over one split of the
    key list. Writes unnormalised acc [R, d], running max m and sum l for the merge."""
    pid_r, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < C * G
    i = r // G  # query index in the chunk
    h = kvh * G + r % G  # query head
    half = tl.arange(0, HALF_P)  # HALF padded to a power of two >= 16 (tl.dot's least K)
    dim_ok = half < HALF
    inv_freq = tl.load(inv_freq_ptr + half, mask=dim_ok, other=0.0)
    q_pos = tl.load(qpos_ptr + i, mask=row_ok, other=0).to(tl.float32)
    q_base = q_ptr + (i * H + h)[:, None] * (2 * HALF)
    q_ok = row_ok[:, None] & dim_ok[None, :]
    q1 = tl.load(q_base + half[None, :], mask=q_ok, other=0.0).to(tl.float32)
    q2 = tl.load(q_base + HALF + half[None, :], mask=q_ok, other=0.0).to(tl.float32)
    q1, q2 = _rope_halves(q1, q2, q_pos, inv_freq, rope_scale)
    q1 *= sm_scale
    q2 *= sm_scale

    m = tl.full((BLOCK_R,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_R,), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_R, HALF_P), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_R, HALF_P), dtype=tl.float32)
    lo = split * keys_per_split
    last_row = tl.minimum(pid_r * BLOCK_R + BLOCK_R, C * G) - 1
    hi = tl.minimum(tl.minimum(lo + keys_per_split, N), last_row // G + N - C + 1)  # causal bound
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        col_ok = j < hi
        kv_ok = col_ok[:, None] & dim_ok[None, :]
        slot = tl.load(slot_ptr + j, mask=col_ok, other=0).to(tl.int64)
        k_pos = tl.load(kpos_ptr + j, mask=col_ok, other=0).to(tl.float32)
        k_base = k_ptr + slot[:, None] * k_stride_slot + kvh * k_stride_kvh
        k1 = tl.load(k_base + half[None, :], mask=kv_ok, other=0.0).to(tl.float32)
        k2 = tl.load(k_base + HALF + half[None, :], mask=kv_ok, other=0.0).to(tl.float32)
        k1, k2 = _rope_halves(k1, k2, k_pos, inv_freq, rope_scale)
        s = dot_fp32(q1, tl.trans(k1), IEEE) + dot_fp32(q2, tl.trans(k2), IEEE)
        visible = col_ok[None, :] & (j[None, :] <= i[:, None] + N - C)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v_base = v_ptr + slot[:, None] * v_stride_slot + kvh * v_stride_kvh
        v1 = tl.load(v_base + half[None, :], mask=kv_ok, other=0.0).to(tl.float32)
        v2 = tl.load(v_base + HALF + half[None, :], mask=kv_ok, other=0.0).to(tl.float32)
        acc1 = acc1 * alpha[:, None] + dot_fp32(p, v1, IEEE)
        acc2 = acc2 * alpha[:, None] + dot_fp32(p, v2, IEEE)
        m = m_new

    row = split * C * H + i * H + h  # partials laid out [split, query, head]
    out_base = acc_ptr + row[:, None] * (2 * HALF)
    tl.store(out_base + half[None, :], acc1, mask=q_ok)
    tl.store(out_base + HALF + half[None, :], acc2, mask=q_ok)
    tl.store(m_ptr + row, m, mask=row_ok)
    tl.store(l_ptr + row, l, mask=row_ok)


@triton.jit
def _merge_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, rows, splits, D: tl.constexpr, D_P: tl.constexpr,
                  BLOCK_ROWS: tl.constexpr):
    """Program = a block of (query, head) rows: out = sum_s w_s acc_s / sum_s w_s l_s with
    w_s = exp(m_s - max_s m_s). Splits that saw no visible key have m = -inf, so weight 0."""
    r = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    r_ok = r < rows
    dims = tl.arange(0, D_P)  # D padded to a power of two
    ok = r_ok[:, None] & (dims < D)[None, :]
    m_all = tl.full((BLOCK_ROWS,), float("-inf"), dtype=tl.float32)
    for s in range(splits):
        m_all = tl.maximum(m_all, tl.load(m_ptr + s * rows + r, mask=r_ok, other=0.0))
    num = tl.zeros((BLOCK_ROWS, D_P), dtype=tl.float32)
    den = tl.zeros((BLOCK_ROWS,), dtype=tl.float32)
    for s in range(splits):
        w = tl.exp(tl.load(m_ptr + s * rows + r, mask=r_ok, other=0.0) - m_all)  # split 0 sees key 0: finite max
        den += w * tl.load(l_ptr + s * rows + r, mask=r_ok, other=1.0)
        acc = tl.load(acc_ptr + (s * rows + r)[:, None].to(tl.int64) * D + dims[None, :], mask=ok, other=0.0)
        num += w[:, None] * acc
    out = num / den[:, None]
    tl.store(out_ptr + r[:, None].to(tl.int64) * D + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=ok)


TARGET_PROGRAMS = 128  # decode split-K: programs to aim for (H100 sweep: 128 / 512 / 2048 within noise, 128 best)
# (rows, warps) of a program's tile: decode rows (one query x its group) fill a 16-row tile; a chunk
# gets larger tiles, so each program rotates and reads a key block once for rows / group queries
DECODE_TILE, CHUNK_TILE = (16, 4), (128, 8)


def sparse_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    slots: torch.Tensor,
    key_pos: torch.Tensor,
    q_pos: torch.Tensor,
    inv_freq: torch.Tensor,
    rope_scale: float = 1.0,
    sm_scale: float | None = None,
) -> torch.Tensor:
    """Triton version of :func:`sparse_attention_ref` (same arguments, same result up to rounding)."""
    c, n_heads, d = q.shape
    n_kv, n = k_pool.shape[1], slots.numel()
    group = n_heads // n_kv
    sm_scale = d ** -0.5 if sm_scale is None else sm_scale
    block_r, warps = DECODE_TILE if c * group <= DECODE_TILE[0] else CHUNK_TILE
    block_n = 64 if d <= 128 else 32
    row_blocks = triton.cdiv(c * group, block_r)
    splits = max(1, min(triton.cdiv(n, block_n), TARGET_PROGRAMS // (row_blocks * n_kv)))
    keys_per_split = triton.cdiv(triton.cdiv(n, splits), block_n) * block_n
    splits = triton.cdiv(n, keys_per_split)
    acc = torch.empty(splits, c, n_heads, d, dtype=torch.float32, device=q.device)
    m = torch.empty(splits, c, n_heads, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    _sparse_attention_kernel[(row_blocks, n_kv, splits)](
        q.contiguous(), k_pool, v_pool, slots.contiguous(), key_pos.contiguous(), q_pos.contiguous(),
        inv_freq.to(device=q.device, dtype=torch.float32).contiguous(), acc, m, l,
        c, n, group, n_heads, keys_per_split, float(rope_scale), float(sm_scale),
        k_pool.stride(0), k_pool.stride(1), v_pool.stride(0), v_pool.stride(1),
        HALF=d // 2, HALF_P=max(16, triton.next_power_of_2(d // 2)), BLOCK_R=block_r, BLOCK_N=block_n,
        IEEE=torch.float32 in (q.dtype, k_pool.dtype), num_warps=warps,
    )
    out = torch.empty(c, n_heads, d, dtype=q.dtype, device=q.device)
    rows = c * n_heads
    _merge_kernel[(triton.cdiv(rows, 16),)](acc, m, l, out, rows, splits, D=d, D_P=triton.next_power_of_2(d),
                                            BLOCK_ROWS=16)
    return out

"""Sparse paged attention: a chunk of queries attends to a list of cache slots, with RoPE applied
on the fly at the positions the policy chose.

The slot list holds the context first and the chunk's own tokens last (their K/V are already in the
cache), so causality is "bottom-right aligned": key j is visible to query i iff j <= i + n - c.
Query head h reads kv head h // (n_heads // n_kv_heads).

The Triton kernel reads keys and values in place (no gather), rotates q and each key block in
registers, and runs a flash-style online softmax. The key list is split across programs
(split-K, "flash decoding") so that a single decode query still spreads over the whole GPU;
the partial results are merged by their log-sum-exp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..rope import rotate


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
def _mm(a, b, IEEE: tl.constexpr):
    """a [M, K] @ b [K, N] in fp32 (tf32 products for 16-bit data, which tf32 holds exactly)."""
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b, input_precision="tf32")


@triton.jit
def _sparse_attention_kernel(
    q_ptr, k_ptr, v_ptr, slot_ptr, kpos_ptr, qpos_ptr, inv_freq_ptr, acc_ptr, m_ptr, l_ptr,
    C, N, G, H, keys_per_split, rope_scale, sm_scale, stride_slot, stride_kvh,
    HALF: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):
    """One program: a block of (query, head-of-group) rows of kv head ``kvh`` over one split of the
    key list. Writes unnormalised acc [R, d], running max m and sum l for the merge."""
    pid_r, kvh, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = r < C * G
    i = r // G  # query index in the chunk
    h = kvh * G + r % G  # query head
    half = tl.arange(0, HALF)
    inv_freq = tl.load(inv_freq_ptr + half)
    q_pos = tl.load(qpos_ptr + i, mask=row_ok, other=0).to(tl.float32)
    q_base = q_ptr + (i * H + h)[:, None] * (2 * HALF)
    q1 = tl.load(q_base + half[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    q2 = tl.load(q_base + HALF + half[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    q1, q2 = _rope_halves(q1, q2, q_pos, inv_freq, rope_scale)
    q1 *= sm_scale
    q2 *= sm_scale

    m = tl.full((BLOCK_R,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_R,), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_R, HALF), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_R, HALF), dtype=tl.float32)
    lo = split * keys_per_split
    last_row = tl.minimum(pid_r * BLOCK_R + BLOCK_R, C * G) - 1
    hi = tl.minimum(tl.minimum(lo + keys_per_split, N), last_row // G + N - C + 1)  # causal bound
    for start in range(lo, hi, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        col_ok = j < hi
        slot = tl.load(slot_ptr + j, mask=col_ok, other=0).to(tl.int64)
        k_pos = tl.load(kpos_ptr + j, mask=col_ok, other=0).to(tl.float32)
        kv_base = slot[:, None] * stride_slot + kvh * stride_kvh
        k1 = tl.load(k_ptr + kv_base + half[None, :], mask=col_ok[:, None], other=0.0).to(tl.float32)
        k2 = tl.load(k_ptr + kv_base + HALF + half[None, :], mask=col_ok[:, None], other=0.0).to(tl.float32)
        k1, k2 = _rope_halves(k1, k2, k_pos, inv_freq, rope_scale)
        s = _mm(q1, tl.trans(k1), IEEE) + _mm(q2, tl.trans(k2), IEEE)
        visible = col_ok[None, :] & (j[None, :] <= i[:, None] + N - C)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v1 = tl.load(v_ptr + kv_base + half[None, :], mask=col_ok[:, None], other=0.0).to(tl.float32)
        v2 = tl.load(v_ptr + kv_base + HALF + half[None, :], mask=col_ok[:, None], other=0.0).to(tl.float32)
        acc1 = acc1 * alpha[:, None] + _mm(p, v1, IEEE)
        acc2 = acc2 * alpha[:, None] + _mm(p, v2, IEEE)
        m = m_new

    row = split * C * H + i * H + h  # partials laid out [split, query, head]
    out_base = acc_ptr + row[:, None] * (2 * HALF)
    tl.store(out_base + half[None, :], acc1, mask=row_ok[:, None])
    tl.store(out_base + HALF + half[None, :], acc2, mask=row_ok[:, None])
    tl.store(m_ptr + row, m, mask=row_ok)
    tl.store(l_ptr + row, l, mask=row_ok)


TARGET_PROGRAMS = 512  # enough programs to fill a large GPU several times over


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
    block_r, block_n = 16, 64 if d <= 128 else 32
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
        k_pool.stride(0), k_pool.stride(1),
        HALF=d // 2, BLOCK_R=block_r, BLOCK_N=block_n, IEEE=q.dtype == torch.float32,
    )
    if splits == 1:
        return (acc[0] / l[0, ..., None]).to(q.dtype)
    m_all = m.max(dim=0).values
    w = torch.exp(m - m_all)  # splits that saw no visible key have m = -inf -> weight 0
    return ((acc * w[..., None]).sum(0) / (l * w).sum(0)[..., None]).to(q.dtype)

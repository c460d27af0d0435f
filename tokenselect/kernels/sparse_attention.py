"""Sparse paged attention: a chunk of queries attends to a list of cache slots, with RoPE applied
on the fly at the positions the policy chose.

The slot list holds the context first and the chunk's own tokens last (their K/V are already in the
cache), so causality is "bottom-right aligned": key j is visible to query i iff j <= i + n - c.
Query head h reads kv head h // (n_heads // n_kv_heads).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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

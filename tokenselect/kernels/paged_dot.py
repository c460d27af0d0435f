"""Paged dot product (TokenSelect, Algorithm 2): per-head scores of one query against cached keys
read in place through a slot list.

    scores[h, t] = <q[h], k_pool[slots[t], h // group]>,   group = n_heads // n_kv_heads

Keys are the un-rotated (pre-RoPE) keys of the cache, so the scores are position-agnostic.
"""

from __future__ import annotations

import torch


def paged_dot_ref(q: torch.Tensor, k_pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """q: [n_heads, head_dim], k_pool: [n_slots, n_kv_heads, head_dim], slots: [N] -> scores [n_heads, N] fp32."""
    n_heads, n_kv = q.shape[0], k_pool.shape[1]
    keys = k_pool[slots].float()  # [N, n_kv, d]
    qg = q.float().view(n_kv, n_heads // n_kv, -1)  # [n_kv, group, d]
    return torch.einsum("kgd,nkd->kgn", qg, keys).reshape(n_heads, -1)

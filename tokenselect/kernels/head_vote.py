"""Head soft vote (TokenSelect, Eq. 7): every head's scores are normalised by a softmax over the
candidate tokens, then summed over heads, so each head has one vote of equal weight.

    vote[t] = sum_h softmax_t(scale * <q[h], k_pool[slots[t], h // group]>)
"""

from __future__ import annotations

import torch

from .paged_dot import paged_dot_ref


def head_soft_vote_ref(q: torch.Tensor, k_pool: torch.Tensor, slots: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """q: [n_heads, head_dim], k_pool: [n_slots, n_kv_heads, head_dim], slots: [N] -> vote [N] fp32."""
    scores = paged_dot_ref(q, k_pool, slots) * scale
    return torch.softmax(scores, dim=-1).sum(dim=0)

"""Head soft vote (TokenSelect, Eq. 7): every head's scores are normalised by a softmax over the
candidate tokens, then summed over heads, so each head has one vote of equal weight.

    vote[t] = sum_h softmax_t(scale * <q[h], k_pool[slots[t], h // group]>)

The Triton version reads every key exactly once. Pass 1 is the paged dot product, which also keeps
per head and key block the running max and sum of exponentials; the per-head totals are combined
(a few KB); pass 2 turns the scores into normalised probabilities and sums them over heads. Pass 2
reads the fp32 scores (n_heads * 4 = 128 bytes per token for 32 heads) instead of re-reading the
keys (n_kv * head_dim * 2 = 2 KB per token for Llama-3-8B in bf16): recomputing the scores would
double the bytes of the whole selection step, storing them adds about 1/8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .paged_dot import paged_dot_ref, scores_with_stats


def head_soft_vote_ref(q: torch.Tensor, k_pool: torch.Tensor, slots: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """q: [n_heads, head_dim], k_pool: [n_slots, n_kv_heads, head_dim], slots: [N] -> vote [N] fp32."""
    scores = paged_dot_ref(q, k_pool, slots) * scale
    return torch.softmax(scores, dim=-1).sum(dim=0)


@triton.jit
def _vote_kernel(s_ptr, m_ptr, inv_l_ptr, out_ptr, H, N, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pass 2, program = block of tokens: vote[t] = sum_h exp(s[h, t] - m[h]) * inv_l[h]."""
    heads = tl.arange(0, BLOCK_H)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    head_ok, col_ok = heads < H, cols < N
    s = tl.load(s_ptr + heads[:, None].to(tl.int64) * N + cols[None, :], mask=head_ok[:, None] & col_ok[None, :],
                other=float("-inf"))
    m = tl.load(m_ptr + heads, mask=head_ok, other=0.0)
    inv_l = tl.load(inv_l_ptr + heads, mask=head_ok, other=0.0)
    vote = tl.sum(tl.exp(s - m[:, None]) * inv_l[:, None], axis=0)
    tl.store(out_ptr + cols, vote, mask=col_ok)


def head_soft_vote(q: torch.Tensor, k_pool: torch.Tensor, slots: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Triton version of :func:`head_soft_vote_ref` (same arguments, same result up to rounding)."""
    n_heads, n = q.shape[0], slots.numel()
    out = torch.empty(n, dtype=torch.float32, device=q.device)
    if n == 0:
        return out
    scores, m, l = scores_with_stats(q, k_pool, slots, scale, stats=True)
    m_head = m.max(dim=1).values  # [n_heads]
    inv_l = 1.0 / (l * torch.exp(m - m_head[:, None])).sum(dim=1)
    block_h = triton.next_power_of_2(n_heads)
    block_n = max(16, 4096 // block_h)
    _vote_kernel[(triton.cdiv(n, block_n),)](scores, m_head, inv_l, out, n_heads, n, BLOCK_H=block_h, BLOCK_N=block_n)
    return out

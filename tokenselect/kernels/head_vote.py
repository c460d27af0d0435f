"""Head soft vote (TokenSelect, Eq. 7): every head's scores are normalised by a softmax over the
candidate tokens, then summed over heads, so each head has one vote of equal weight.

    vote[t] = sum_h softmax_t(scale * <q[h], k_pool[slots[t], h // group]>)

The Triton version reads every key exactly once. Pass 1 is the paged dot product, which also keeps
per head and key block the max and sum of exponentials; a small kernel combines them into per-head
totals; pass 2 turns the scores into normalised probabilities and sums them over heads. Pass 2
reads the fp32 scores (n_heads * 4 = 128 bytes per token for 32 heads) instead of re-reading the
keys (n_kv * head_dim * 2 = 2 KB per token for Llama-3-8B in bf16): recomputing the scores would
double the bytes of the whole selection step, storing them adds about 1/8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fast_exp import exp_ftz
from .launch import dependent, wait_for_inputs
from .paged_dot import paged_dot_ref, scores_block, scores_with_stats


def head_soft_vote_ref(q: torch.Tensor, k_pool: torch.Tensor, slots: torch.Tensor, scale: float = 1.0,
                       n_valid: torch.Tensor | None = None) -> torch.Tensor:
    """q: [n_heads, head_dim], k_pool: [n_slots, n_kv_heads, head_dim], slots: [N] -> vote [N] fp32.

    n_valid: None, or an int64 tensor [] on q's device: only ``slots[:n_valid]`` are candidates (a slot
    list of fixed length, as a CUDA graph needs, of which a prefix is live); the rest vote -inf, all of
    them when it is 0 (a decode graph's Selection Cache hit).
    A batch: q [B, n_heads, head_dim], slots [B, N] (or [N], shared), n_valid [B] -> [B, N], each sequence's
    vote as it alone would get it."""
    if q.dim() == 3:
        return torch.stack([head_soft_vote_ref(q[b], k_pool, slots if slots.dim() == 1 else slots[b], scale,
                                               None if n_valid is None else n_valid.reshape(-1)[b])
                            for b in range(q.shape[0])])
    scores = paged_dot_ref(q, k_pool, slots) * scale
    if n_valid is None:
        return torch.softmax(scores, dim=-1).sum(dim=0)
    live = torch.arange(slots.numel(), device=q.device) < n_valid
    vote = torch.softmax(scores.masked_fill(~live, float("-inf")), dim=-1).sum(dim=0)
    return vote.masked_fill(~live, float("-inf"))


@triton.jit
def _head_totals_kernel(m_ptr, l_ptr, m_out_ptr, inv_l_out_ptr, n_valid_ptr, n_blocks, block_n, n_heads,
                        stride_valid, BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """Program = (head h, sequence b of the batch): combine the per-block (max, sum of exp) into the head's max M[h]
    and 1 / sum_t exp(s[h, t] - M[h]); MASKED: over the blocks (of block_n tokens) that hold any of the
    first *n_valid_ptr tokens only, the others' stats are not written."""
    wait_for_inputs()
    h = tl.program_id(0) + tl.program_id(1).to(tl.int64) * n_heads  # the (sequence, head) pair
    row = h * n_blocks
    if MASKED:
        n_valid_ptr += tl.program_id(1).to(tl.int64) * stride_valid
        n_blocks = tl.minimum(tl.cdiv(tl.load(n_valid_ptr).to(tl.int32), block_n), n_blocks)
    # one pass, each lane's sum kept relative to its own running max: the 32 programs of a decode step at 1M tokens
    # walk 8,192 blocks a head, and a second pass took them from 7.3 to 10.3 us a layer (benchmarks/head_vote_gpu.py)
    top = tl.full((BLOCK,), float("-inf"), dtype=tl.float32)
    total = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_blocks, BLOCK):
        b = start + tl.arange(0, BLOCK)
        m = tl.load(m_ptr + row + b, mask=b < n_blocks, other=float("-inf"))
        l = tl.load(l_ptr + row + b, mask=b < n_blocks, other=0.0)
        new = tl.maximum(top, m)
        base = tl.where(new == float("-inf"), 0.0, new)
        total = total * exp_ftz(top - base) + l * exp_ftz(m - base)
        top = new
    m_head = tl.max(top, axis=0)
    total = tl.sum(total * exp_ftz(top - tl.where(m_head == float("-inf"), 0.0, m_head)), axis=0)
    # no live token (a decode graph's Selection Cache hit): 0 and 0, so that the vote computes no inf - inf
    tl.store(m_out_ptr + h, tl.where(total > 0, m_head, 0.0))
    tl.store(inv_l_out_ptr + h, tl.where(total > 0, 1.0 / tl.maximum(total, 1e-30), 0.0))


@triton.jit
def _vote_kernel(s_ptr, m_ptr, inv_l_ptr, out_ptr, n_valid_ptr, H, N, stride_valid, stride_s, BLOCK_H: tl.constexpr,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Pass 2, program = (block of the scores kernel's BLOCK_N tokens, sequence b of the batch):
    vote[t] = sum_h exp(s[h, t] - m[h]) * inv_l[h]; MASKED: -inf for t >= *n_valid_ptr (a block without live tokens
    reads nothing and stores -inf). The scores' rows (``stride_s`` apart) are padded to whole blocks
    (``scores_with_stats``; the padding unwritten), so a block loads without a column mask, and the columns past the
    live ones, padding included, are masked in the vote's result: with the live count in its mask the load took an
    element at a time (Triton cannot tell such a mask constant over a vector), 32 scalar loads a thread where 8
    vector loads do with blocks of 128, compiled for sm_90 (42.4 -> 36.4 us a layer at 1M on an H200)."""
    wait_for_inputs()
    seq = tl.program_id(1).to(tl.int64)
    s_ptr += seq * H * stride_s
    m_ptr += seq * H
    inv_l_ptr += seq * H
    out_ptr += seq * N
    heads = tl.arange(0, BLOCK_H)
    first = tl.program_id(0) * BLOCK_N
    cols = first + tl.arange(0, BLOCK_N)
    head_ok, col_ok = heads < H, cols < N
    n_live = N
    if MASKED:
        n_live = tl.load(n_valid_ptr + seq * stride_valid).to(tl.int32)
        col_ok = col_ok & (cols < n_live)
    if first < n_live:
        s = tl.load(s_ptr + heads[:, None].to(tl.int64) * stride_s + cols[None, :], mask=head_ok[:, None],
                    other=float("-inf"))
        m = tl.load(m_ptr + heads, mask=head_ok, other=0.0)
        inv_l = tl.load(inv_l_ptr + heads, mask=head_ok, other=0.0)
        # a head's share below 2^-126 counts 0 (exp_ftz): tokens with no larger share tie at 0, and the top-k takes
        # tied tokens in order where denormals would have ranked them by shares under 1e-38
        vote = tl.sum(exp_ftz(s - m[:, None]) * inv_l[:, None], axis=0)
        tl.store(out_ptr + cols, tl.where(col_ok, vote, float("-inf")), mask=cols < N)
    else:
        tl.store(out_ptr + cols, tl.full((BLOCK_N,), float("-inf"), tl.float32), mask=cols < N)


# (blocks' stats a step, warps) of the head totals: a program a head walks its blocks' stats, 16,384 blocks at 1M
# tokens (64 keys a block), each step a load's latency. At 1M on an H200, 1,024 a step on 4 warps took 12.6 us a
# layer, these 7.6 (results/supporting/scores_tile_1m_h200.md)
TOTALS_TILE = (4096, 8)


def head_soft_vote(q: torch.Tensor, k_pool: torch.Tensor, slots: torch.Tensor, scale: float = 1.0,
                   n_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of :func:`head_soft_vote_ref` (same arguments, same result up to rounding); a batch in
    one launch of each kernel."""
    batch, n_heads = (q.shape[0], q.shape[1]) if q.dim() == 3 else (1, q.shape[0])
    n = slots.shape[-1]
    out = torch.empty(batch, n, dtype=torch.float32, device=q.device)
    if n and batch:
        scores, m, l = scores_with_stats(q.view(batch, n_heads, -1) if q.dim() == 2 else q, k_pool, slots, scale,
                                         stats=True, n_valid=n_valid)
        m_head = torch.empty(batch, n_heads, dtype=torch.float32, device=q.device)
        inv_l = torch.empty_like(m_head)
        valid = None if n_valid is None else n_valid.reshape(-1)
        stride_valid = 0 if valid is None else valid.stride(0)
        (block, warps), pdl = TOTALS_TILE, dependent(out)
        _head_totals_kernel[(n_heads, batch)](m, l, m_head, inv_l, valid, m.shape[2], scores_block(q, k_pool),
                                              n_heads, stride_valid, BLOCK=block, MASKED=valid is not None,
                                              num_warps=warps, launch_pdl=pdl)
        _vote_kernel[(m.shape[2], batch)](scores, m_head, inv_l, out, valid, n_heads, n, stride_valid,
                                          scores.stride(1), BLOCK_H=triton.next_power_of_2(n_heads),
                                          BLOCK_N=scores_block(q, k_pool), MASKED=valid is not None,
                                          launch_pdl=pdl)
    return out if q.dim() == 3 else out[0]

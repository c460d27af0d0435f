"""Window mass (InfLLM's local score): the attention that each key of the local window received from
a chunk of queries, summed over the queries that held it inside their window of n_local tokens.

The chunk's c queries (token indices t0..t0+c-1) attended a slot list of n columns: the context first,
then the chunk's own c tokens, causally (the same list as sparse attention's, so query i sees column
j iff j <= i + n - c). The last w = t0 + c - lo columns are the tokens lo..t0+c-1. With logits
s[h, i, j] = scale * <q[i, h], k_pool[slots[j], h // group]> of the un-rotated values and lse[h, i]
over the columns query i sees,

    mass[j', h] = sum_i exp(s[h, i, n - w + j'] - lse[h, i]) * [0 <= (t0 + i) - (lo + j') < n_local]

The Triton kernel works like flash attention without values. A program holds a block of
(query, head-of-group) rows of one kv head, the group padded to a power of two. Pass 1 runs over
the columns its rows see and keeps each row's running max and sum of exponentials (its lse); pass 2
re-scores only the columns that some row of the block holds in its window, sums the probabilities
over the block's queries per (column, head) and adds them to the output with atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dot import mma, query_dot_type
from .launch import dependent, wait_for_inputs
from .paged_dot import paged_dot
from .sparse_attention import LOG2E

SCORE_ELEMENTS = 1 << 24  # the reference's logits per block of queries, at most this many floats


def window_mass_ref(q: torch.Tensor, k_pool: torch.Tensor, attended: torch.Tensor, c: int, t0: int, lo: int,
                    n_local: int, scale: float) -> torch.Tensor:
    """q: [c, n_heads, head_dim] un-rotated queries of tokens t0..t0+c-1; k_pool: [n_slots, n_kv_heads,
    head_dim]; attended: [n] slots, the chunk's own c last; keys lo..t0+c-1 are the last w = t0 + c - lo
    columns. -> mass [w, n_heads] fp32."""
    n_heads, d = q.shape[1:]
    n, n_kv, w = attended.numel(), k_pool.shape[1], t0 + c - lo
    keys = k_pool[attended].float()  # [n, n_kv, d]; fp8 keys upcast
    cols = torch.arange(n, device=q.device)
    mass = torch.zeros(w, n_heads, device=q.device)
    block = max(1, SCORE_ELEMENTS // (n_heads * n))
    for s in range(0, c, block):
        part = q[s:s + block].float()
        b = part.shape[0]
        logits = torch.einsum("bkgd,nkd->kgbn", part.view(b, n_kv, -1, d), keys).reshape(n_heads, b, n) * scale
        last = torch.arange(s, s + b, device=q.device) + n - c  # the last column each query sees: its own
        logits.masked_fill_(cols[None, :] > last[:, None], float("-inf"))
        lse = logits.logsumexp(dim=-1, keepdim=True)  # [H, b, 1]
        p = (logits[..., n - w:] - lse).exp()  # [H, b, w]
        dist = last[:, None] - cols[None, n - w:]  # query's token index - key's token index
        mass += (p * ((dist >= 0) & (dist < n_local))).sum(dim=1).T
    return mass


@triton.jit
def _logits(q, start, N, kvh, k_ptr, slot_ptr, k_stride_slot, k_stride_kvh, dims, dim_ok, qk_scale,
            BLOCK_N: tl.constexpr, DOT_TY: tl.constexpr, IEEE: tl.constexpr):
    """Columns [start, start + BLOCK_N) of the list against the rows q [R, D_P]: returns (the columns
    [BLOCK_N], logits in log2 units [R, BLOCK_N]); columns past N read no key and score 0."""
    col = start + tl.arange(0, BLOCK_N)
    col_ok = col < N
    slot = tl.load(slot_ptr + col, mask=col_ok, other=0).to(tl.int64)
    k = tl.load(k_ptr + slot[:, None] * k_stride_slot + kvh * k_stride_kvh + dims[None, :],
                mask=col_ok[:, None] & dim_ok[None, :], other=0.0)
    return col, mma(q, tl.trans(k.to(DOT_TY)), IEEE) * qk_scale


@triton.jit
def _online_lse(m, l, s):
    """The running max m and sum of exponentials l [R] of each row, updated with the logits s [R, BLOCK_N]
    (log2 units); m must be finite afterwards."""
    m_new = tl.maximum(m, tl.max(s, axis=1))
    return m_new, l * tl.exp2(m - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)


@triton.jit
def _window_mass_kernel(q_ptr, k_ptr, slot_ptr, out_ptr, C, N, W, n_local, G, H, qk_scale, k_stride_slot,
                        k_stride_kvh, D: tl.constexpr, D_P: tl.constexpr, G_P: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, DOT_TY: tl.constexpr, IEEE: tl.constexpr):
    """Program (row block, kv head kvh): rows r = query * G_P + head-in-group, BLOCK_R // G_P queries.
    Logits are in log2 units (``qk_scale`` = scale * log2 e). out [W, H] fp32 must start at zero."""
    wait_for_inputs()
    pid_r, kvh = tl.program_id(0), tl.program_id(1)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    i, g = r // G_P, r % G_P  # query index in the chunk, head in the group
    row_ok = (i < C) & (g < G)
    dims = tl.arange(0, D_P)  # D padded to a power of two >= 16
    dim_ok = dims < D
    q = tl.load(q_ptr + (i * H + kvh * G + g)[:, None] * D + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0).to(DOT_TY)
    last = i + N - C  # the last column each row sees: its query's own
    first_i = pid_r * BLOCK_R // G_P
    hi = tl.minimum(first_i + BLOCK_R // G_P, C) + N - C  # columns past the block's last query's own unseen
    full = (first_i + N - C + 1) // BLOCK_N * BLOCK_N  # blocks below this are seen in full by every row

    # pass 1: lse of every row over the columns it sees; column 0 comes first and every row sees it
    m = tl.full((BLOCK_R,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for start in range(0, full, BLOCK_N):
        _, s = _logits(q, start, N, kvh, k_ptr, slot_ptr, k_stride_slot, k_stride_kvh, dims, dim_ok, qk_scale,
                       BLOCK_N, DOT_TY, IEEE)
        m, l = _online_lse(m, l, s)
    for start in range(full, hi, BLOCK_N):  # the causal edge
        col, s = _logits(q, start, N, kvh, k_ptr, slot_ptr, k_stride_slot, k_stride_kvh, dims, dim_ok, qk_scale,
                         BLOCK_N, DOT_TY, IEEE)
        m, l = _online_lse(m, l, tl.where(col[None, :] <= last[:, None], s, float("-inf")))
    lse = m + tl.log2(l)

    # pass 2: columns inside some row's window, i.e. 0 <= last - col < n_local, and among the last W
    heads = kvh * G + tl.arange(0, G_P)
    head_ok = tl.arange(0, G_P) < G
    for start in range(tl.maximum(N - W, first_i + N - C - n_local + 1), hi, BLOCK_N):
        col, s = _logits(q, start, N, kvh, k_ptr, slot_ptr, k_stride_slot, k_stride_kvh, dims, dim_ok, qk_scale,
                         BLOCK_N, DOT_TY, IEEE)
        dist = last[:, None] - col[None, :]
        counted = row_ok[:, None] & (dist >= 0) & (dist < n_local)
        p = tl.where(counted, tl.exp2(s - lse[:, None]), 0.0)
        mass = tl.sum(tl.reshape(p, (BLOCK_R // G_P, G_P, BLOCK_N)), axis=0)  # [G_P, BLOCK_N]
        tl.atomic_add(out_ptr + (col - (N - W))[None, :] * H + heads[:, None], mass,
                      mask=head_ok[:, None] & (col < N)[None, :], sem="relaxed")


# (rows, columns, warps, pipeline stages) of a program, columns halved for head_dim > 128. H100 sweep at
# 128K, Llama-3-8B shape (c 512, group 4, 8.9K columns, n_local 4096), bf16 keys: 64 x 128 on 4 warps
# 0.23 ms, 64 x 64 0.29, 128 x 128 0.32, 8 warps slower. fp32 products run on CUDA cores with fp32
# operands, so fp32 data gets a smaller tile, as in sparse attention (9 ms at that shape).
TILE, FP32_TILE = (64, 128, 4, 3), (32, 32, 4, 2)
# Queries per program of 16-bit data, at most 128 rows: a program adds its sums with one atomic per
# (column, head), so fewer queries mean more atomics (group 8: 0.42 ms at 16 queries, 0.58 at 8).
MIN_QUERIES = 16


def window_mass(q: torch.Tensor, k_pool: torch.Tensor, attended: torch.Tensor, c: int, t0: int, lo: int,
                n_local: int, scale: float) -> torch.Tensor:
    """Triton version of :func:`window_mass_ref` (same arguments, same result up to rounding).

    A decode step's single query would leave the fused kernel one program per kv head walking every column
    (0.27 ms a layer at 512K, fp8 keys); its n_heads * n logits are few, so the paged dot product (which
    spreads the columns over the GPU) computes them and torch takes the softmax."""
    n_heads, d = q.shape[1], q.shape[2]
    n_kv, n, w = k_pool.shape[1], attended.numel(), t0 + c - lo
    if c == 1:
        logits = paged_dot(q[0], k_pool, attended).mul_(scale)  # [H, n]; the query sees every column
        mass = (logits[:, n - w:] - logits.logsumexp(dim=1, keepdim=True)).exp_()
        mass[:, :max(0, w - n_local)] = 0  # keys n_local or more tokens before the query
        return mass.T
    group = n_heads // n_kv
    out = torch.zeros(w, n_heads, dtype=torch.float32, device=q.device)
    dot_ty, ieee = query_dot_type(q.dtype, k_pool.dtype)
    block_r, block_n, warps, stages = FP32_TILE if ieee else TILE
    group_p = triton.next_power_of_2(group)
    block_r = max(block_r, group_p, 0 if ieee else min(128, MIN_QUERIES * group_p))
    block_n = block_n if d <= 128 else block_n // 2
    _window_mass_kernel[(triton.cdiv(c * group_p, block_r), n_kv)](
        q.contiguous(), k_pool, attended.contiguous(), out, c, n, w, n_local, group, n_heads, float(scale) * LOG2E,
        k_pool.stride(0), k_pool.stride(1), D=d, D_P=max(16, triton.next_power_of_2(d)), G_P=group_p,
        BLOCK_R=block_r, BLOCK_N=block_n, DOT_TY=dot_ty, IEEE=ieee,
        num_warps=warps, num_stages=stages, launch_pdl=dependent(out))
    return out

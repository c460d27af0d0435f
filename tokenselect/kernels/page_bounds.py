"""Page scores (QUEST's selection): the best head's upper bound on q . k over each page of a sequence's keys.

    u[h, p]   = sum_c max(q[h, c] * lo[row, p, kv(h), c], q[h, c] * hi[row, p, kv(h), c])
    score[p]  = max_h u[h, p]

``lo`` and ``hi`` hold every sequence's pages' channel-wise key minima and maxima (one row per sequence, a
layer's view of QUEST's bounds), query head h reading kv head h // group. The page at ``tail_at`` is the partial
last page, whose bounds come from its live keys at each step (``tail_lo``, ``tail_hi``) in place of the row's.
With ``n_valid`` only pages 0..n_valid-1 are scored; the others score -inf and are not read, so the row's spare
capacity past the live pages costs nothing.

In PyTorch this is a gather of the sequence's row of bounds (a copy of 2 x pages x n_kv x d fp32), the tail
written into the copy, and the products for every query head materialised ([pages, n_kv, group, d], twice)
before the sum and the max: at 128K tokens in pages of 16 about 0.5 GB of memory traffic a layer. The kernel
reads each page's bounds once, in place, and keeps the products in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import dependent, wait_for_inputs


def page_scores_ref(query: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, row: torch.Tensor,
                    tail_lo: torch.Tensor, tail_hi: torch.Tensor, tail_at: torch.Tensor,
                    n_valid: torch.Tensor | None = None) -> torch.Tensor:
    """query: [H, d] (any float dtype, read in fp32); lo, hi: [rows, P, n_kv, d] fp32; row, tail_at: int64 [] on
    their device (tail_at < P); tail_lo, tail_hi: [n_kv, d] fp32; n_valid: None or int64 [] -> scores [P] fp32."""
    index = row.view(1)  # a device scalar: index ops (indexing with it would read it on the host)
    lo, hi = (b.index_select(0, index)[0] for b in (lo, hi))  # [P, n_kv, d], copies the tail is written into
    for bounds, tail in ((lo, tail_lo), (hi, tail_hi)):
        bounds.index_copy_(0, tail_at.view(1), tail[None])
    n_kv, d = lo.shape[1], lo.shape[2]
    q = query.float().reshape(n_kv, -1, d)[None]  # [1, n_kv, group, d]: each kv head meets its group's queries
    bound = torch.maximum(q * lo[:, :, None], q * hi[:, :, None]).sum(dim=-1)  # [P, n_kv, group]
    scores = bound.flatten(1).amax(dim=1)
    if n_valid is None:
        return scores
    return scores.masked_fill(torch.arange(scores.numel(), device=scores.device) >= n_valid, float("-inf"))


@triton.jit
def _page_scores_kernel(q_ptr, lo_ptr, hi_ptr, row_ptr, tail_lo_ptr, tail_hi_ptr, tail_at_ptr, n_valid_ptr, out_ptr,
                        P, n_kv, group, d, stride_row, stride_page, stride_kvh, HAS_N_VALID: tl.constexpr,
                        BLOCK_P: tl.constexpr, D_P: tl.constexpr):
    """Program = BLOCK_P pages: for each kv head its bounds [BLOCK_P, d] are loaded once (the tail page's from
    the tail bounds) and met by each query head of its group; the running max over heads is stored. Pages past
    ``n_valid`` are not loaded (masked) and store -inf."""
    wait_for_inputs()
    pages = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    dims = tl.arange(0, D_P)
    live = P
    if HAS_N_VALID:
        live = tl.minimum(tl.load(n_valid_ptr), P)
    page_ok, dim_ok = pages < live, dims < d
    ok = page_ok[:, None] & dim_ok[None, :]
    is_tail = (pages == tl.load(tail_at_ptr))[:, None]
    base = tl.load(row_ptr) * stride_row + pages.to(tl.int64)[:, None] * stride_page + dims[None, :]
    best = tl.full((BLOCK_P,), float("-inf"), dtype=tl.float32)
    for kvh in range(n_kv):
        lo = tl.load(lo_ptr + base + kvh * stride_kvh, mask=ok, other=0.0)
        hi = tl.load(hi_ptr + base + kvh * stride_kvh, mask=ok, other=0.0)
        tail_lo = tl.load(tail_lo_ptr + kvh * d + dims, mask=dim_ok, other=0.0)
        tail_hi = tl.load(tail_hi_ptr + kvh * d + dims, mask=dim_ok, other=0.0)
        lo = tl.where(is_tail, tail_lo[None, :], lo)
        hi = tl.where(is_tail, tail_hi[None, :], hi)
        for g in range(group):
            q = tl.load(q_ptr + (kvh * group + g) * d + dims, mask=dim_ok, other=0.0).to(tl.float32)[None, :]
            bound = tl.sum(tl.where(ok, tl.maximum(q * lo, q * hi), 0.0), axis=1)
            best = tl.maximum(best, bound)
    tl.store(out_ptr + pages, tl.where(page_ok, best, float("-inf")), mask=pages < P)


BLOCK_P = 32  # pages a program: 32 x 128 fp32 bounds, twice, per kv head in registers


def page_scores(query: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, row: torch.Tensor, tail_lo: torch.Tensor,
                tail_hi: torch.Tensor, tail_at: torch.Tensor, n_valid: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of :func:`page_scores_ref` (same arguments, same result up to rounding)."""
    rows, n_pages, n_kv, d = lo.shape
    if hi.stride() != lo.stride() or lo.stride(3) != 1 or tail_lo.shape != (n_kv, d) or tail_hi.shape != (n_kv, d):
        raise ValueError(f"lo and hi must share their strides with contiguous channels, and the tail bounds be "
                         f"[{n_kv}, {d}]: lo {tuple(lo.shape)} {lo.stride()}, hi {hi.stride()}, "
                         f"tail {tuple(tail_lo.shape)} {tuple(tail_hi.shape)}")
    out = torch.empty(n_pages, dtype=torch.float32, device=lo.device)
    if n_pages == 0:
        return out
    _page_scores_kernel[(triton.cdiv(n_pages, BLOCK_P),)](
        query.contiguous(), lo, hi, row, tail_lo.contiguous(), tail_hi.contiguous(), tail_at,
        tail_at if n_valid is None else n_valid, out, n_pages, n_kv, query.shape[0] // n_kv, d, lo.stride(0),
        lo.stride(1), lo.stride(2), HAS_N_VALID=n_valid is not None, BLOCK_P=BLOCK_P,
        D_P=max(16, triton.next_power_of_2(d)), launch_pdl=dependent(out))
    return out

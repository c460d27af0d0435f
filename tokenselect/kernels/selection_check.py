"""The Selection Cache's decision for one (sequence, layer), or for a batch of sequences at one layer, as one kernel.

    hit  = valid[row, layer] and  <q, unit[row, layer]> >= theta * max(|q|, eps)
    miss = not hit;   counts += (hit, miss)
    candidates = live if miss else 0          (optional: the selection's live candidates, none on a hit)

A batch (q: [B, n], row, live, candidates: [B]) is decided by one launch, a program a sequence: a decode graph of
B sequences holds one node a layer for it, not B.

``unit`` holds the cached queries scaled to unit length, so the test is cos(q, q_cached) >= theta.
In PyTorch this is about a dozen tiny kernels (two gathers, a dot, a norm, comparisons, the counters);
in a decode step captured as one CUDA graph that is a dozen graph nodes per layer on every step, hit or
miss, where the kernel is one (and ``candidates`` spares the step one more, a ``live * miss``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import dependent, wait_for_inputs
from .operands import batch_rows

EPS = 1e-8  # as torch.nn.functional.cosine_similarity: a zero vector has cosine 0 with anything
BLOCK = 1024


def selection_check_ref(q: torch.Tensor, unit: torch.Tensor, valid: torch.Tensor, row: torch.Tensor, layer: int,
                        theta: float, counts: torch.Tensor, live: torch.Tensor | None = None,
                        candidates: torch.Tensor | None = None) -> torch.Tensor:
    """q: [n] (any float dtype: computed in fp32); unit: [rows, n_layers, n] fp32; valid: [rows, n_layers] bool;
    row: int64 []; counts: [2] int64 (hits, misses), incremented in place. Returns miss: bool []. With live (int64
    []) and candidates (int64 []), candidates is set to live on a miss and to 0 on a hit.
    A batch: q [B, n], row [B], live and candidates [B] (views of any stride) -> miss [B], each sequence's
    decision as it alone would get it."""
    if q.dim() == 2:
        return torch.stack([selection_check_ref(q[b], unit, valid, row[b], layer, theta, counts,
                                                None if live is None else live[b],
                                                None if candidates is None else candidates[b])
                            for b in range(q.shape[0])])
    index = row.view(1)  # a device scalar: index ops (indexing with it would read it on the host)
    q = q.float()
    dot = torch.dot(unit[:, layer].index_select(0, index)[0], q)
    miss = ~(valid[:, layer].index_select(0, index)[0] & (dot >= theta * torch.linalg.vector_norm(q).clamp_min(EPS)))
    counts += torch.stack([~miss, miss])
    if candidates is not None:
        candidates.copy_(live * miss)
    return miss


@triton.jit
def _selection_check_kernel(q_ptr, unit_ptr, valid_ptr, row_ptr, counts_ptr, miss_ptr, live_ptr, cand_ptr, layer,
                            n_layers, n, theta, stride_q, stride_row, stride_live, stride_cand, EPS: tl.constexpr,
                            BLOCK: tl.constexpr, CANDIDATES: tl.constexpr):
    """Program = sequence b of the batch: the dot product and the query's squared norm in fp32, then the decision
    (CANDIDATES: and candidates[b] = live[b] on a miss, 0 on a hit); the counters add up over the programs."""
    wait_for_inputs()
    b = tl.program_id(0).to(tl.int64)
    entry = tl.load(row_ptr + b * stride_row) * n_layers + layer
    dot = tl.zeros((BLOCK,), dtype=tl.float32)
    sq = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n, BLOCK):
        i = start + tl.arange(0, BLOCK)
        ok = i < n
        q = tl.load(q_ptr + b * stride_q + i, mask=ok, other=0.0).to(tl.float32)
        dot += q * tl.load(unit_ptr + entry * n + i, mask=ok, other=0.0)
        sq += q * q
    norm = tl.maximum(tl.sqrt(tl.sum(sq, axis=0)), EPS)
    hit = (tl.load(valid_ptr + entry) != 0) & (tl.sum(dot, axis=0) >= theta * norm)
    tl.store(miss_ptr + b, (~hit).to(tl.uint8))
    tl.atomic_add(counts_ptr, hit.to(tl.int64))
    tl.atomic_add(counts_ptr + 1, (~hit).to(tl.int64))
    if CANDIDATES:
        tl.store(cand_ptr + b * stride_cand, tl.where(hit, 0, tl.load(live_ptr + b * stride_live)))


def selection_check(q: torch.Tensor, unit: torch.Tensor, valid: torch.Tensor, row: torch.Tensor, layer: int,
                    theta: float, counts: torch.Tensor, live: torch.Tensor | None = None,
                    candidates: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of :func:`selection_check_ref` (same arguments, same result up to rounding)."""
    batched = q.dim() == 2
    qs = batch_rows(q, q.shape[0] if batched else 1)
    rows = row.reshape(-1)
    miss = torch.empty(rows.numel(), dtype=torch.bool, device=q.device)
    given = candidates is not None
    if given and (live is None or candidates.dtype != torch.int64 or live.dtype != torch.int64):
        raise ValueError("candidates needs live, both int64 []")
    if rows.numel() != qs.shape[0] or (given and not live.numel() == candidates.numel() == rows.numel()):
        raise ValueError(f"{qs.shape[0]} queries for {rows.numel()} rows")
    lives, cands = (live.reshape(-1), candidates.view(-1)) if given else (miss, miss)
    _selection_check_kernel[(rows.numel(),)](
        qs, unit, valid.view(torch.uint8), rows, counts, miss.view(torch.uint8), lives, cands, layer, unit.shape[1],
        qs.shape[1], float(theta), qs.stride(0), rows.stride(0), lives.stride(0), cands.stride(0), EPS=EPS,
        BLOCK=BLOCK, CANDIDATES=given, launch_pdl=dependent(miss))
    return miss if batched else miss[0]

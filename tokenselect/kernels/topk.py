"""Top-k over the vote: the positions of the k largest scores, in ascending order (the order the chosen
tokens are attended in).

The reference is ``torch.topk`` then a sort of the k positions. The Triton version is a radix select that
writes its picks in order, so nothing is sorted. Each fp32 score maps to a uint32 key with the same order;
four passes histogram one byte of the keys each (from the top), over the keys that share the bytes found
so far, which pins the k-th largest key byte by byte (the last program of a pass to finish finds its byte
and stores it for the launches after: none of their programs derives it again; 43 -> 38 us a call over 1M
scores on an H200, results/supporting/topk_stored_digits_h200.md; once every key that shares the bytes found is
wanted, the passes after return at once: 96% of SmolLM2's votes settle before the last byte, 37.8 -> 32.4 us a call
over 1M scores, results/supporting/topk_settled_h200.md); then two small kernels write the picks: per block of
scores, count the keys above the k-th and equal to it; every block then knows where its picks start from the counts
of the blocks before it and writes them through a prefix sum. Ties at the k-th key are taken in order until k are
chosen, so the result is always k distinct positions.

With ``n_valid`` only scores[:n_valid] are read; the others count as -inf (a whole-step graph's fixed-length
span, whose live prefix is 0 on a decode step's Selection Cache hit: then the first k positions come back, and
only the last kernel does anything: the passes and the counts return at once). With ``values`` the picks are
gathered from it (the chosen tokens' cache slots rather than their indices: no gather after the top-k).

A batch (scores [B, N], n_valid [B], values [B, N], out [B, k]) runs in the same six launches, a row of programs a
sequence: a decode graph of B sequences holds six nodes a layer for it, not 6B.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import dependent, wait_for_inputs
from .operands import rows_in_place


def topk_ref(scores: torch.Tensor, k: int, n_valid: torch.Tensor | None = None,
             values: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """scores: [N] -> indices [min(k, N)] int64 of the largest scores, ascending; of scores tied at the k-th largest,
    the first ones (as the Triton kernel takes them, so that a list does not depend on how far past its live part
    it is padded: keys cached before RoPE tie wherever a token repeats).
    n_valid: None, or an int64 tensor []: scores[n_valid:] count as -inf.
    values: None, or [N] int64: return values[indices] instead.
    out: None, or a contiguous int64 [min(k, N)] to write the result to (and return).
    A batch: scores [B, N], n_valid [B], values [B, N], out [B, min(k, N)] -> [B, min(k, N)], each row's top-k as
    it alone would get it."""
    if scores.dim() == 2:
        picks = torch.stack([topk_ref(scores[b], k, None if n_valid is None else n_valid.reshape(-1)[b],
                                      None if values is None else values[b]) for b in range(scores.shape[0])])
        return picks if out is None else _checked_out(out, picks.shape).copy_(picks)
    n = scores.numel()
    index = torch.arange(n, device=scores.device)
    if n_valid is not None:
        scores = scores.masked_fill(index >= n_valid, float("-inf"))
    k = min(k, n)
    kth = torch.topk(scores, k, sorted=False).values.min() if k else scores.new_zeros(())
    above, tied = scores > kth, scores == kth
    first_tied = tied & (torch.cumsum(tied, 0) <= k - above.sum())  # static shapes, no host read (graphs, meta)
    picked = torch.topk(torch.where(above | first_tied, n - index, -1), k, sorted=False).indices.sort().values
    picked = picked if values is None else values[picked]
    return picked if out is None else _checked_out(out, picked.shape).copy_(picked)


def _checked_out(out: torch.Tensor, shape: tuple) -> torch.Tensor:
    if out.shape != shape or out.dtype != torch.int64 or (out.numel() > 1 and out.stride(-1) != 1):
        raise ValueError(f"out must be an int64 tensor of shape {tuple(shape)} (each row contiguous), not {out.dtype} "
                         f"{tuple(out.shape)}")
    return out


@triton.jit
def _live_count(n_valid_ptr, N, MASKED: tl.constexpr):
    """How many scores are live: min(*n_valid_ptr, N) with MASKED, else N."""
    if MASKED:
        return tl.minimum(tl.load(n_valid_ptr).to(tl.int32), N)
    return N


@triton.jit
def _keys(scores_ptr, i, n_live):
    """uint32 keys of scores[i] ordered as the scores are; positions at or past n_live are -inf, not read."""
    x = tl.load(scores_ptr + i, mask=i < n_live, other=float("-inf")).to(tl.float32)
    bits = x.to(tl.int32, bitcast=True)
    flip = (bits >> 31) | -2147483648  # all bits of a negative score, the sign bit of any other
    return (bits ^ flip).to(tl.uint32, bitcast=True)


# a sequence's state between the launches, int32: the four passes' histograms of 256 bins; a ticket a pass (the
# programs done with it); after each pass, the top bytes of the k-th largest key found so far and how many of the
# keys that share them are still to be taken; whether a pass settled the choice (below)
HIST, TICKETS, FOUND, SETTLED, STATE = (tl.constexpr(at) for at in (0, 1024, 1028, 1036, 1040))


@triton.jit
def _digit(hist_ptr, prefix, rest):
    """From a pass's whole histogram (256 bins, read past the L1 cache: other programs added to it) of the keys that
    share ``prefix``: the prefix with the k-th largest key's next byte, how many keys that share it are still to be
    taken (``rest`` were before), and how many share it."""
    bins = tl.arange(0, 256)
    h = tl.load(hist_ptr + bins, volatile=True)
    at_least = tl.sum(h, axis=0) - tl.cumsum(h, axis=0) + h  # keys whose byte is >= each bin
    digit = tl.max(tl.where(at_least >= rest, bins, 0), axis=0)
    rest -= tl.sum(tl.where(bins > digit, h, 0), axis=0)
    return prefix * 256 + digit.to(tl.uint32), rest, tl.sum(tl.where(bins == digit, h, 0), axis=0)


@triton.jit
def _found(state_ptr, k, PASSES: tl.constexpr):
    """The top 8 * PASSES bits of the k-th largest key, and how many of the keys that share them are still to be
    taken: stored by the last program of pass PASSES - 1 (none before pass 0)."""
    if PASSES == 0:
        return tl.full((), 0, tl.uint32), k
    at = state_ptr + FOUND + 2 * (PASSES - 1)
    return tl.load(at).to(tl.uint32, bitcast=True), tl.load(at + 1)


@triton.jit
def _histogram_kernel(scores_ptr, state_ptr, n_valid_ptr, N, k, stride_s, stride_valid, PASS: tl.constexpr,
                      BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """Program = (block of scores, sequence b of the batch: its row of scores, its state): add the histogram of byte
    PASS of its keys that share the bytes found by the passes before into its pass's histogram. Program 0 also adds
    the scores past n_valid (all -inf, not read). The pass's last program to finish (by its ticket) finds the next
    byte for the passes after it, so that none of their programs derives it again. Where every key that shares the
    bytes found is to be taken, the choice is settled: the k-th largest key's lower bytes do not change it, so the
    passes after return at once, and the count and write kernels take every key from the lowest with that prefix."""
    wait_for_inputs()
    shift: tl.constexpr = 24 - 8 * PASS
    seq = tl.program_id(1).to(tl.int64)
    scores_ptr += seq * stride_s
    state_ptr += seq * STATE
    if MASKED:
        n_valid_ptr += seq * stride_valid
    n_live = _live_count(n_valid_ptr, N, MASKED)
    if PASS > 0:  # settled by a pass before: nothing is left to histogram
        n_live = tl.where(tl.load(state_ptr + SETTLED) != 0, 0, n_live)
    if n_live > 0:  # none live (or settled): the write kernel needs no histogram
        prefix, rest = _found(state_ptr, k, PASS)
        hist_ptr = state_ptr + HIST + PASS * 256
        start = tl.program_id(0) * BLOCK
        if start < n_live:
            i = start + tl.arange(0, BLOCK)
            key = _keys(scores_ptr, i, n_live)
            match = i < n_live
            if PASS > 0:
                match = match & ((key >> (shift + 8)) == prefix)
            part = tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=match)
            tl.atomic_add(hist_ptr + tl.arange(0, 256), part, mask=part > 0, sem="relaxed")  # (none for empty bins)
        if MASKED:
            dead = tl.full((), 0x007FFFFF, tl.uint32)  # the key of -inf
            add = tl.program_id(0) == 0
            if PASS > 0:
                add = add & ((dead >> (shift + 8)) == prefix)
            if add:
                tl.atomic_add(hist_ptr + ((dead >> shift) & 255).to(tl.int32), N - n_live, sem="relaxed")
        # every thread's adds above are done before the barrier, and the ticket's release (cumulative) publishes
        # them all; the last program's ticket acquires every program's
        tl.debug_barrier()
        if tl.atomic_add(state_ptr + TICKETS + PASS, 1, sem="acq_rel") == tl.num_programs(0) - 1:
            prefix, rest, sharing = _digit(hist_ptr, prefix, rest)
            # settled: the lowest key with this prefix stands for the k-th largest; every key above it and every
            # key equal to it (fewer than ``rest``, which counts them all) is taken, k in all
            settled = (sharing == rest) & (PASS < 3)
            at = state_ptr + FOUND + 2 * tl.where(settled, 3, PASS)
            tl.store(at, (prefix << tl.where(settled, shift, 0)).to(tl.int32, bitcast=True))
            tl.store(at + 1, rest)
            tl.store(state_ptr + SETTLED, settled.to(tl.int32))


# n_blocks only offsets a sequence's counts: were it specialized, a prompt whose block count first reaches a
# multiple of 16 would stop for a compile (0.6 s at 128K tokens, after a 40K warm-up)
@triton.jit(do_not_specialize=["n_blocks"])
def _count_kernel(scores_ptr, state_ptr, n_valid_ptr, counts_ptr, N, k, n_blocks, stride_s, stride_valid,
                  BLOCK: tl.constexpr, MASKED: tl.constexpr):
    """Program = (block b of scores, sequence of the batch): counts[b] = (#keys above the k-th largest, #keys equal
    to it); nothing when none is live (the write kernel needs no count then)."""
    wait_for_inputs()
    seq = tl.program_id(1).to(tl.int64)
    scores_ptr += seq * stride_s
    state_ptr += seq * STATE
    counts_ptr += seq * 2 * n_blocks
    if MASKED:
        n_valid_ptr += seq * stride_valid
    n_live = _live_count(n_valid_ptr, N, MASKED)
    if n_live > 0:
        kth, _ = _found(state_ptr, k, 4)
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        key = _keys(scores_ptr, i, n_live)
        ok = i < N
        tl.store(counts_ptr + 2 * tl.program_id(0), tl.sum((ok & (key > kth)).to(tl.int32), axis=0))
        tl.store(counts_ptr + 2 * tl.program_id(0) + 1, tl.sum((ok & (key == kth)).to(tl.int32), axis=0))


@triton.jit
def _write_picks(values_ptr, out_ptr, at, i, pick, GATHER: tl.constexpr):
    """out[at] = i (GATHER: values[i]) where pick."""
    if GATHER:
        tl.store(out_ptr + at, tl.load(values_ptr + i, mask=pick, other=0).to(tl.int64), mask=pick)
    else:
        tl.store(out_ptr + at, i.to(tl.int64), mask=pick)


@triton.jit(do_not_specialize=["n_blocks"])  # as _count_kernel
def _write_kernel(scores_ptr, state_ptr, n_valid_ptr, counts_ptr, values_ptr, out_ptr, N, k, n_blocks, stride_s,
                  stride_valid, stride_values, stride_out, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr,
                  MASKED: tl.constexpr, GATHER: tl.constexpr):
    """Program = (block b of scores, sequence of the batch): write the positions it picks to out (GATHER: values at
    them), after the picks of blocks < b. A key above the k-th largest is picked; one equal to it while fewer than
    the ties wanted came before it. None live: positions 0..k-1 (all tie at -inf; the first are taken)."""
    wait_for_inputs()
    b = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    scores_ptr += seq * stride_s
    state_ptr += seq * STATE
    counts_ptr += seq * 2 * n_blocks
    out_ptr += seq * stride_out
    if MASKED:
        n_valid_ptr += seq * stride_valid
    if GATHER:
        values_ptr += seq * stride_values
    i = b * BLOCK + tl.arange(0, BLOCK)
    n_live = _live_count(n_valid_ptr, N, MASKED)
    if n_live == 0:
        _write_picks(values_ptr, out_ptr, i, i, i < k, GATHER)
    else:
        kth, ties_wanted = _found(state_ptr, k, 4)
        above_before = tl.zeros((BLOCK_C,), dtype=tl.int32)
        ties_before = tl.zeros((BLOCK_C,), dtype=tl.int32)
        for start in range(0, b, BLOCK_C):
            j = start + tl.arange(0, BLOCK_C)
            above_before += tl.load(counts_ptr + 2 * j, mask=j < b, other=0)
            ties_before += tl.load(counts_ptr + 2 * j + 1, mask=j < b, other=0)
        ties_before = tl.sum(ties_before, axis=0)
        ok = i < N
        key = _keys(scores_ptr, i, n_live)
        tie = (ok & (key == kth)).to(tl.int32)
        tie_rank = ties_before + tl.cumsum(tie, axis=0) - tie  # tied keys before this one, in every block
        pick = ((ok & (key > kth)) | ((tie > 0) & (tie_rank < ties_wanted))).to(tl.int32)
        first = tl.sum(above_before, axis=0) + tl.minimum(ties_before, ties_wanted)  # picks of the blocks before
        _write_picks(values_ptr, out_ptr, first + tl.cumsum(pick, axis=0) - pick, i, pick > 0, GATHER)


BLOCK, BLOCK_C = 2048, 1024


def topk(scores: torch.Tensor, k: int, n_valid: torch.Tensor | None = None,
         values: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version of :func:`topk_ref` (same arguments; the same positions where no two scores tie at the
    k-th largest, otherwise the first of the tied ones). scores: fp32, bf16 or fp16; a batch in one launch of each
    kernel."""
    if values is not None and values.shape != scores.shape:
        raise ValueError(f"values of shape {tuple(values.shape)} for scores of shape {tuple(scores.shape)}")
    batched = scores.dim() == 2
    rows = scores if batched else scores[None]
    batch, n = rows.shape
    k = min(k, n)
    shape = (batch, k) if batched else (k,)
    out = torch.empty(shape, dtype=torch.int64, device=scores.device) if out is None else _checked_out(out, shape)
    if k == 0 or batch == 0:
        return out
    rows = rows_in_place(rows)
    outs = out if batched else out[None]
    n_blocks = triton.cdiv(n, BLOCK)
    state = torch.zeros(batch, STATE.value, dtype=torch.int32, device=scores.device)
    counts = torch.empty(batch, n_blocks, 2, dtype=torch.int32, device=scores.device)
    masked = n_valid is not None
    valid = n_valid.reshape(-1) if masked else None
    if masked and valid.numel() != batch:
        raise ValueError(f"{valid.numel()} live counts for {batch} rows of scores")
    stride_valid = valid.stride(0) if masked else 0
    grid, pdl = (n_blocks, batch), dependent(rows)  # six launches, one device
    for p in range(4):
        _histogram_kernel[grid](rows, state, valid, n, k, rows.stride(0), stride_valid, PASS=p, BLOCK=BLOCK,
                                MASKED=masked, launch_pdl=pdl)
    _count_kernel[grid](rows, state, valid, counts, n, k, n_blocks, rows.stride(0), stride_valid, BLOCK=BLOCK,
                        MASKED=masked, launch_pdl=pdl)
    gather = values is not None
    value_rows = rows_in_place(values if batched else values[None]) if gather else None
    _write_kernel[grid](rows, state, valid, counts, value_rows if gather else outs, outs, n, k, n_blocks,
                        rows.stride(0), stride_valid, value_rows.stride(0) if gather else 0, outs.stride(0),
                        BLOCK=BLOCK, BLOCK_C=BLOCK_C, MASKED=masked, GATHER=gather, launch_pdl=pdl)
    return out

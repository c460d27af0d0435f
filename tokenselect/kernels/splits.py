"""Split-K: a kernel whose few rows would leave most SMs idle walks its keys in splits, one program each, and a
second step merges the splits' partial results (sparse attention's decode, ReAttention's vote). The grid is planned
on the host for the whole key list; where only a live prefix of it is read (a count on the device), each program
shares that prefix out among the same splits."""

from __future__ import annotations

import triton
import triton.language as tl


def key_splits(n: int, block_n: int, most: int, min_blocks: int = 1) -> tuple[int, int]:
    """n keys walked in blocks of block_n, in at most ``most`` splits of at least ``min_blocks`` blocks each (one
    split at least) -> (splits, keys a split: a multiple of block_n). Every split holds keys; the last may hold
    fewer."""
    splits = max(1, min(triton.cdiv(n, block_n * min_blocks), most))
    keys_per_split = triton.cdiv(triton.cdiv(n, splits), block_n) * block_n
    return triton.cdiv(n, keys_per_split), keys_per_split


@triton.jit
def live_keys_per_split(n_live, BLOCK_N: tl.constexpr):
    """In a program of a grid whose axis 2 is the splits: the keys a split takes of the n_live read on the device
    (``key_splits``' rule for the live prefix; splits past it take none)."""
    return tl.cdiv(tl.cdiv(n_live, tl.num_programs(2)), BLOCK_N) * BLOCK_N

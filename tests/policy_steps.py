"""Running one policy step by hand, as the engine does (``start_step`` then ``attend``), and reading back what
it attends, for the tests that check a policy's choice on hand-built caches."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenselect.kv_cache import KVCache
from tokenselect.policies import start_step

OWN = 128  # slots kept free for the step's own tokens


def cache_with_keys(keys: torch.Tensor, select_dtype=None) -> tuple[KVCache, torch.Tensor]:
    """A one-layer cache holding ``keys: [T, n_kv, d]`` at shuffled slots -> (cache, slot table [T]), on the keys'
    device. The first OWN slots are taken too (so slots and token indices differ), and a step's own tokens use
    them."""
    t, n_kv, d = keys.shape
    cache = KVCache(1, t + OWN, n_kv, d, torch.float32, keys.device, select_dtype=select_dtype)
    cache.allocate(OWN)
    slots = cache.allocate(t)[torch.randperm(t)]
    cache.write(0, slots, keys, torch.randn_like(keys))
    return cache, slots


@dataclass
class Seen:
    """What a step's queries attend besides their own tokens: slots [n] in attention order, their positions
    [n], and the queries' positions [w]."""

    slots: torch.Tensor
    positions: torch.Tensor
    q_positions: torch.Tensor

    def order(self, slots: torch.Tensor) -> list[int]:
        """Token indices of the attended slots, in attention order (slots: the sequence's slot table)."""
        index = {int(s): i for i, s in enumerate(slots)}
        return [index[int(s)] for s in self.slots]


def step(policy, past: torch.Tensor, q: torch.Tensor, decode: bool, seq_id: int = 0, layer: int = 0,
         layers: int = 1) -> Seen:
    """One step of ``q: [w, H, d]`` after the tokens at slots ``past`` (their own at the free slots 0..w-1), in
    ``layers`` layers (the policy's per-sequence state is kept for all of them) -> what layer ``layer`` attends."""
    w = q.shape[0]
    own = torch.arange(w, device=past.device)
    table = torch.cat([past, own])
    seq = start_step(policy, seq_id, table, past.numel(), w, decode, tuple(q.shape), q.dtype)
    for each in range(layers):
        got = policy.attend(each, seq, q, own)
        if each == layer:
            assert got.key_pos.dtype == got.q_pos.dtype == torch.int64  # positions index RoPE's tables
            live = got.slots.numel() if got.n_valid is None else int(got.n_valid)
            slots, positions, q_positions = (x.clone() for x in (got.slots[:live], got.key_pos[:live], got.q_pos))
    # no token is attended twice: a partial choice's closed-up tail (the entries past n_valid) must not count
    assert slots.unique().numel() == slots.numel(), f"a slot attended twice: {slots.tolist()}"
    mine = torch.isin(slots, own)
    return Seen(slots[~mine], positions[~mine], q_positions)


def cache_store(cache, row: int, layer: int, q: torch.Tensor, selection: torch.Tensor) -> None:
    """Store q [n_heads, head_dim] and selection [width] in a Selection Cache's ``row`` for ``layer`` as a decode
    step's miss stores them (``update`` with miss True)."""
    dev = cache.unit.device
    cache.update(torch.tensor(row, device=dev), layer, q.to(dev), selection.to(dev), torch.tensor(True, device=dev))


def cache_miss(cache, row: int | torch.Tensor, layer: int, q: torch.Tensor) -> torch.Tensor | None:
    """The decision a decode step takes (``decide``'s miss: bool [] on the device, None with the cache off)."""
    return cache.decide(torch.as_tensor(row, device=q.device), layer, q)[0]


def cache_lookup(cache, seq_id: int, layer: int, q: torch.Tensor) -> torch.Tensor | None:
    """seq_id's stored selection for ``layer`` where q is similar enough to its query (a hit), else None; seq_id
    gets a row on first use."""
    if cache.theta is None:
        return None
    row = cache.row(seq_id, q.numel(), q.device)
    return None if cache_miss(cache, row, layer, q).item() else cache.selection[row, layer]

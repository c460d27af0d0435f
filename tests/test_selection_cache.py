"""The Selection Cache's similarity check and TokenSelect's decode hit path: a hit reuses the cached choice
(the chosen middle tokens) and must give exactly the plan a fresh assembly of that choice gives."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenselect.kernels import get_kernels
from tokenselect.kv_cache import KVCache
from tokenselect.policies import SeqView
from tokenselect.policies.selection_cache import SelectionCache
from tokenselect.policies.tokenselect import TokenSelect

TORCH = get_kernels("torch")


CPU = torch.device("cpu")


def test_a_hit_is_a_cosine_at_or_above_theta():
    gen = torch.Generator().manual_seed(0)
    cached = torch.randn(4, 16, generator=gen)
    for q in (torch.randn(4, 16, generator=gen), cached + 0.01 * torch.randn(4, 16, generator=gen), -cached,
              3 * cached, torch.zeros(4, 16)):
        cos = F.cosine_similarity(q.flatten(), cached.flatten(), dim=0).item()
        for theta, want in ((cos - 1e-4, True), (cos + 1e-4, False)):
            cache = SelectionCache(theta, n_layers=2, width=1)
            row = cache.row(0, 64, CPU)
            cache.store(row, 1, cached, torch.tensor([5]))
            assert bool(cache.miss(torch.tensor(row), 1, q)) is not want
            assert bool(cache.miss(torch.tensor(row), 0, q))  # nothing stored for layer 0


def test_lookup_counts_and_returns_the_stored_selection():
    cache = SelectionCache(theta=0.9, n_layers=2, width=3)
    q = torch.randn(2, 8)
    assert cache.lookup(3, 1, q) is None  # nothing stored yet
    cache.store(cache.row(3, 16, CPU), 1, q, torch.tensor([7, 8, 9]))
    assert cache.lookup(3, 1, 2 * q).tolist() == [7, 8, 9]  # the cosine ignores the norm
    assert cache.lookup(3, 1, -q) is None
    assert cache.counts() == (1, 2)
    assert SelectionCache(None, 2, 3).lookup(3, 1, q) is None


def test_rows_are_reused_and_start_empty_and_every_decision_is_counted():
    cache = SelectionCache(theta=0.5, n_layers=1, width=2)
    q = torch.randn(2, 8)
    rows = [cache.row(i, 16, CPU) for i in range(6)]  # past the first allocation: the arrays grow
    assert rows == list(range(6)) and cache.row(4, 16, CPU) == 4
    cache.store(rows[2], 0, q, torch.tensor([1, 2]))
    cache.store(rows[5], 0, q, torch.tensor([3, 4]))
    cache.release(2)
    assert cache.row(99, 16, CPU) == 2  # the freed row, without the old entry
    assert cache.lookup(99, 0, q) is None and cache.lookup(5, 0, q).tolist() == [3, 4]
    assert bool(cache.miss(torch.tensor(5), 0, q)) is False and bool(cache.miss(torch.tensor(5), 0, -q)) is True
    assert cache.counts() == (2, 2)  # eager lookups and device decisions alike
    assert SelectionCache(None, 1, 2).miss(torch.tensor(0), 0, q) is None  # off: always select


@pytest.mark.parametrize("positions", ["reindex", "original"])
def test_hit_plan_equals_a_fresh_assembly_of_the_cached_choice(positions):
    torch.manual_seed(1)
    t0, n_init, n_local, k = 200, 4, 8, 16
    keys = torch.randn(t0 + 8, 2, 16)
    cache = KVCache(1, t0 + 16, 2, 16, torch.float32, torch.device("cpu"))
    cache.allocate(5)  # so slots and token indices differ
    slots = cache.allocate(t0 + 8)[torch.randperm(t0 + 8)]
    cache.write(0, slots, keys, torch.randn_like(keys))
    policy = TokenSelect(cache, TORCH, k=k, n_init=n_init, n_local=n_local, theta=-1.0, positions=positions)
    q = torch.randn(1, 4, 16)
    miss = policy.plan(0, SeqView(9, slots[:t0], decode=True), q)
    index_of = {s: i for i, s in enumerate(slots.tolist())}
    chosen = torch.tensor([index_of[s] - n_init for s in miss.slots[n_init:n_init + k].tolist()])
    for t in (t0, t0 + 1, t0 + 5):  # the window moves on; the cached choice stays
        seq = SeqView(9, slots[:t], decode=True)
        hit = policy.plan(0, seq, torch.randn(1, 4, 16))
        want = policy.assemble(seq, chosen, 1)
        assert torch.equal(hit.slots, want.slots)
        assert torch.equal(hit.positions, want.positions) and torch.equal(hit.q_positions, want.q_positions)
    assert (policy.selection_cache.hits, policy.selection_cache.misses) == (3, 1)

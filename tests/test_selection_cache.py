"""The Selection Cache's similarity check and TokenSelect's decode hit path: a hit reuses the cached
[sinks | chosen] head and must give exactly the plan a fresh assembly of the cached choice gives."""

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


def test_similarity_is_the_cosine():
    gen = torch.Generator().manual_seed(0)
    cache = SelectionCache(theta=0.5)
    cached = torch.randn(4, 16, generator=gen)
    cache.store(0, 0, cached, "selection")
    entry = cache._entries[(0, 0)]
    for q in (torch.randn(4, 16, generator=gen), cached + 0.01 * torch.randn(4, 16, generator=gen), -cached,
              torch.zeros(4, 16)):
        want = F.cosine_similarity(q.flatten(), cached.flatten(), dim=0).item()
        assert cache.similarity(entry, q) == pytest.approx(want, abs=1e-6)


def test_lookup_counts_and_returns_the_stored_selection():
    cache = SelectionCache(theta=0.9)
    q = torch.randn(2, 8)
    assert cache.lookup(3, 1, q) is None  # nothing stored yet
    cache.store(3, 1, q, "chosen")
    assert cache.lookup(3, 1, 2 * q) == "chosen"  # the cosine ignores the norm
    assert cache.lookup(3, 1, -q) is None
    assert (cache.hits, cache.misses) == (1, 2)
    assert SelectionCache(theta=None).lookup(3, 1, q) is None


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

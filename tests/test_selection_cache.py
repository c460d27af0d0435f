"""The Selection Cache's similarity check and TokenSelect's decode hit path: a hit reuses the cached choice
(the chosen middle tokens) between the sinks and the current local window."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenselect.kernels import get_kernels
from tokenselect.policies.selection_cache import SelectionCache
from tokenselect.policies.tokenselect import TokenSelect

from policy_steps import cache_lookup, cache_miss, cache_store, cache_with_keys, step

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
            cache_store(cache, row, 1, cached, torch.tensor([5]))
            assert bool(cache_miss(cache, torch.tensor(row), 1, q)) is not want
            assert bool(cache_miss(cache, torch.tensor(row), 0, q))  # nothing stored for layer 0


@pytest.mark.parametrize("kernels", ["torch", "triton"])
def test_decide_gives_the_candidates_live_on_a_miss_and_none_on_a_hit(kernels):
    kern = get_kernels(kernels)
    # compiled Triton needs CUDA tensors; without a GPU the kernels run in the interpreter on the CPU
    device = torch.device("cuda" if kernels == "triton" and torch.cuda.is_available() else "cpu")
    cache = SelectionCache(0.9, n_layers=1, width=2, check=kern.selection_check, update=kern.selection_update)
    row = torch.tensor(cache.row(0, 16, device), device=device)
    q, live = torch.randn(2, 8, device=device), torch.tensor(37, device=device)
    cache_store(cache, int(row), 0, q, torch.tensor([1, 2], device=device))
    for query, miss in ((2 * q, False), (-q, True)):
        got, candidates = cache.decide(row, 0, query, live)
        assert bool(got) is miss and candidates.dtype == torch.int64 and int(candidates) == (37 if miss else 0)
    assert cache.decide(row, 0, q)[1] is None  # no live given: no candidates
    assert cache.counts() == (2, 1)
    assert SelectionCache(None, 1, 2).decide(row, 0, q, live) == (None, live)  # off: every candidate


def test_lookup_counts_and_returns_the_stored_selection():
    cache = SelectionCache(theta=0.9, n_layers=2, width=3)
    q = torch.randn(2, 8)
    assert cache_lookup(cache, 3, 1, q) is None  # nothing stored yet
    cache_store(cache, cache.row(3, 16, CPU), 1, q, torch.tensor([7, 8, 9]))
    assert cache_lookup(cache, 3, 1, 2 * q).tolist() == [7, 8, 9]  # the cosine ignores the norm
    assert cache_lookup(cache, 3, 1, -q) is None
    assert cache.counts() == (1, 2)
    assert cache_lookup(SelectionCache(None, 2, 3), 3, 1, q) is None


def test_rows_are_reused_and_start_empty_and_every_decision_is_counted():
    cache = SelectionCache(theta=0.5, n_layers=1, width=2)
    q = torch.randn(2, 8)
    rows = [cache.row(i, 16, CPU) for i in range(6)]  # past the first allocation: the arrays grow
    assert rows == list(range(6)) and cache.row(4, 16, CPU) == 4
    cache_store(cache, rows[2], 0, q, torch.tensor([1, 2]))
    cache_store(cache, rows[5], 0, q, torch.tensor([3, 4]))
    cache.release(2)
    assert cache.row(99, 16, CPU) == 2  # the freed row, without the old entry
    assert cache_lookup(cache, 99, 0, q) is None and cache_lookup(cache, 5, 0, q).tolist() == [3, 4]
    assert bool(cache_miss(cache, torch.tensor(5), 0, q)) is False and bool(cache_miss(cache, torch.tensor(5), 0, -q)) is True
    assert cache.counts() == (2, 2)  # eager lookups and device decisions alike
    assert cache_miss(SelectionCache(None, 1, 2), 0, 0, q) is None  # off: always select


@pytest.mark.parametrize("positions", ["reindex", "original"])
def test_a_hit_attends_the_cached_choice_between_the_sinks_and_the_current_window(positions):
    torch.manual_seed(1)
    t0, n_init, n_local, k = 200, 4, 8, 16
    keys = torch.randn(t0 + 8, 2, 16)
    cache, slots = cache_with_keys(keys)
    policy = TokenSelect(cache, TORCH, k=k, n_init=n_init, n_local=n_local, theta=-1.0, positions=positions)
    miss = step(policy, slots[:t0], torch.randn(1, 4, 16), decode=True, seq_id=9)
    chosen = miss.order(slots)[n_init:n_init + k]
    assert chosen == sorted(chosen) and n_init <= chosen[0] and chosen[-1] < t0 - n_local
    for t in (t0, t0 + 1, t0 + 5):  # the window moves on; the cached choice stays
        hit = step(policy, slots[:t], torch.randn(1, 4, 16), decode=True, seq_id=9)
        want = list(range(n_init)) + chosen + list(range(t - n_local, t))
        assert hit.order(slots) == want
        if positions == "reindex":
            assert hit.positions.tolist() == list(range(len(want))) and hit.q_positions.tolist() == [len(want)]
        else:
            assert hit.positions.tolist() == want and hit.q_positions.tolist() == [t]
    assert policy.selection_cache.counts() == (3, 1)

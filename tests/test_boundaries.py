"""Equality at every threshold: a cosine exactly theta, the top-k's live prefix ending exactly at a large score,
ties at the k-th score, k = 0 and k >= n, a context exactly the selection budget (and one token past it).

Each case is built so that its inputs are exact in binary floating point, so "equal" means equal and not
"within rounding": a ``>=`` turned ``>`` (or ``<`` turned ``<=``) changes the outcome.
"""

from __future__ import annotations

import pytest
import torch

from tokenselect.kernels import get_kernels
from tokenselect.kernels.selection_check import selection_check, selection_check_ref
from tokenselect.kernels.selection_update import selection_update, selection_update_ref
from tokenselect.kv_cache import KVCache
from tokenselect.policies.infllm import InfLLM
from tokenselect.policies.quest import Quest
from tokenselect.policies.reattention import ReAttention
from tokenselect.policies.selection_cache import SelectionCache
from tokenselect.policies.streaming import StreamingLLM
from tokenselect.policies.tokenselect import TokenSelect

from policy_steps import cache_lookup, cache_miss, cache_store, cache_with_keys, step

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TRITON, TORCH = get_kernels("triton"), get_kernels("torch")
CHECKS = {"torch": selection_check_ref, "triton": selection_check}


def exact_cosine_pairs():
    """(cached, q, cos) with |q|, <q, cached / |cached|> and so cos(q, cached) exact in fp32."""
    e1 = torch.zeros(16)
    e1[0] = 1.0
    ones4 = torch.zeros(16)
    ones4[:4] = 1.0  # |ones4| = 2
    flip = ones4.clone()
    flip[0] = -1.0
    return [
        (e1, ones4, 0.5),  # <e1, ones4> = 1, |ones4| = 2
        (e1, flip, -0.5),
        (ones4, 3 * ones4, 1.0),  # the same direction: cos 1
        (e1, ones4 - e1, 0.0),  # orthogonal
    ]


@pytest.mark.parametrize("kernel", ["torch", "triton"])
@pytest.mark.parametrize("case", range(4))
def test_a_cosine_equal_to_theta_is_a_hit(kernel, case):
    """hit = cos >= theta (TokenSelect, Algorithm 1): at cos == theta the cache reuses; a hair above it it does not."""
    cached, q, cos = exact_cosine_pairs()[case]
    for theta, hit in ((cos, True), (cos + 2 ** -20, False), (cos - 2 ** -20, True)):
        cache = SelectionCache(theta, n_layers=2, width=1, check=CHECKS[kernel])
        row = cache.row(0, 16, torch.device(DEVICE))
        cache_store(cache, row, 1, cached.to(DEVICE), torch.tensor([5], device=DEVICE))
        miss = cache_miss(cache, torch.tensor(row, device=DEVICE), 1, q.to(DEVICE))
        assert bool(miss) is not hit, (theta, cos)
        assert cache.counts() == ((1, 0) if hit else (0, 1))
        looked = cache_lookup(cache, 0, 1, q.to(DEVICE))
        assert (looked is not None and looked.tolist() == [5]) is hit


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_selection_update_keeps_the_cached_choice_on_a_hit_at_theta(kernel):
    """The graph path's store-or-reuse with the decision taken at cos == theta: the entry is reused, not stored."""
    update = {"torch": selection_update_ref, "triton": selection_update}[kernel]
    cached, q, cos = exact_cosine_pairs()[0]
    cache = SelectionCache(cos, n_layers=1, width=3, check=CHECKS[kernel], update=update)
    row = cache.row(0, 16, torch.device(DEVICE))
    cache_store(cache, row, 0, cached.to(DEVICE), torch.tensor([1, 2, 3], device=DEVICE))
    row_t = torch.tensor(row, device=DEVICE)
    miss = cache_miss(cache, row_t, 0, q.to(DEVICE))
    out = cache.update(row_t, 0, q.to(DEVICE), torch.tensor([7, 8, 9], device=DEVICE), miss)
    assert out.tolist() == [1, 2, 3] and cache.selection[row, 0].tolist() == [1, 2, 3]
    out = cache.update(row_t, 0, q.to(DEVICE), torch.tensor([7, 8, 9], device=DEVICE),
                       torch.tensor(True, device=DEVICE))  # a miss stores the new choice and the new query
    assert out.tolist() == [7, 8, 9] and cache.selection[row, 0].tolist() == [7, 8, 9]
    assert bool(cache_miss(cache, row_t, 0, q.to(DEVICE))) is False  # now cos(q, q) = 1 >= theta


def test_tokenselect_reuses_its_selection_at_cos_equal_theta():
    """Through the policy: a decode query whose cosine with the cached one is exactly theta takes the hit path."""
    torch.manual_seed(0)
    t, n_init, n_local, k = 60, 2, 4, 8
    cache, slots = cache_with_keys(torch.randn(t, 1, 4))
    policy = TokenSelect(cache, TORCH, k=k, n_init=n_init, n_local=n_local, theta=0.5)
    first = torch.tensor([[[1.0, 0.0, 0.0, 0.0]]])
    second = torch.tensor([[[1.0, 1.0, 1.0, 1.0]]])  # cos(first, second) = 1 / 2 exactly
    step(policy, slots, decode=True, seq_id=3, q=first)
    step(policy, slots, decode=True, seq_id=3, q=second)
    assert policy.selection_cache.counts() == (1, 1)
    step(policy, slots, decode=True, seq_id=3, q=torch.tensor([[[1.0, 1.0, 1.0, 1.5]]]))  # cos(first, .) < 0.5
    assert policy.selection_cache.counts() == (1, 2)
    assert policy.stats().as_dict() == {"selection_cache_hits": 1, "selection_cache_misses": 2,
                              "selection_cache_hit_rate": pytest.approx(1 / 3)}
    fresh = TokenSelect(cache, TORCH, k=k, n_init=n_init, n_local=n_local, theta=0.5)
    assert fresh.stats().selection_cache_hit_rate == 0.0  # no decision yet: 0, not a division by zero


# ---- top-k ------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kern", [TORCH, TRITON], ids=["torch", "triton"])
@pytest.mark.parametrize("n, live, k", [(50, 20, 5), (50, 20, 20), (3000, 2048, 100), (7, 0, 3)])
def test_topk_live_prefix_ends_exactly_at_n_valid(kern, n, live, k):
    """scores[n_valid] is the largest score of all, and scores[n_valid - 1] the smallest live one: the first must
    never be picked (it is past the live prefix), the second must be when k covers the whole prefix."""
    gen = torch.Generator().manual_seed(n + live)
    scores = torch.randperm(n, generator=gen).float()
    scores[live:] = 1e6 + torch.arange(n - live).float()  # past the prefix: larger than anything live
    if live:
        scores[live - 1] = -1.0  # the smallest live score sits on the prefix's last position
    want = scores[:live].topk(min(k, live)).indices.sort().values
    if live < k:  # fewer live than k: the first positions past the prefix fill the rest, in order
        want = torch.cat([want, torch.arange(live, k)])
    got = kern.topk(scores.to(DEVICE), k, torch.tensor(live, device=DEVICE)).cpu()
    if kern is TORCH and live < k:  # the reference takes any of the tied -inf positions past the prefix
        assert torch.equal(got[:live], want[:live]) and torch.equal(got, got.unique()) and (got[live:] >= live).all()
    else:
        assert torch.equal(got, want)
    assert (live - 1 in got.tolist()) is (0 < live <= k)


@pytest.mark.parametrize("kern", [TORCH, TRITON], ids=["torch", "triton"])
def test_topk_k_zero_and_k_at_or_past_n(kern):
    scores = torch.tensor([3.0, -1.0, 7.0, 0.5, 2.0]).to(DEVICE)
    assert kern.topk(scores, 0).numel() == 0
    for k in (5, 6, 100):  # k >= n: every position, in order
        assert kern.topk(scores, k).cpu().tolist() == [0, 1, 2, 3, 4]
    assert kern.topk(scores, 4).cpu().tolist() == [0, 2, 3, 4]  # k = n - 1 drops the smallest
    assert kern.topk(scores, 1).cpu().tolist() == [2]


@pytest.mark.parametrize("kern", [TORCH, TRITON], ids=["torch", "triton"])
def test_topk_ties_at_the_kth_score(kern):
    """Every score above the k-th is taken; of the scores equal to it, exactly as many as are needed."""
    scores = torch.tensor([1.0, 5.0, 3.0, 3.0, 0.0, 3.0, 5.0, 3.0]).to(DEVICE)
    for k, above in ((2, [1, 6]), (3, [1, 6]), (5, [1, 6]), (6, [1, 6])):
        got = kern.topk(scores, k).cpu()
        assert got.numel() == k and torch.equal(got, got.unique())  # k distinct positions, ascending
        assert set(above) <= set(got.tolist())
        assert sorted(scores.cpu()[got].tolist()) == sorted(scores.cpu().tolist())[-k:]
    if kern is TRITON:  # the Triton kernel takes the first of the tied ones
        assert kern.topk(scores, 3).cpu().tolist() == [1, 2, 6]


# ---- the selection budget against the context ------------------------------------------------------------------

def _pool(t: int) -> tuple[KVCache, torch.Tensor]:
    torch.manual_seed(t)
    cache = KVCache(1, t + 40, 2, 8, torch.float32, torch.device("cpu"))
    cache.allocate(7)  # slots != token indices
    slots = cache.allocate(t)[torch.randperm(t)]
    cache.write(0, slots, torch.randn(t, 2, 8), torch.randn(t, 2, 8))
    return cache, slots


POLICIES = {
    "tokenselect": lambda cache: TokenSelect(cache, TORCH, k=8, n_init=2, n_local=4, theta=None),
    "reattention": lambda cache: ReAttention(cache, TORCH, window=64, n_init=2, n_local=4, span=1, n_spans=4,
                                                chunk=8),
    "quest": lambda cache: Quest(cache, TORCH, k=8, n_init=2, n_local=4, page_size=2),
}


@pytest.mark.parametrize("name", sorted(POLICIES))
@pytest.mark.parametrize("decode", [False, True])
def test_a_context_equal_to_the_budget_is_attended_whole(name, decode):
    """n_init + budget + n_local == t: everything, in order, at its own position; one token more: a selection of
    exactly n_init + budget + n_local tokens."""
    probe = POLICIES[name](_pool(1)[0])
    budget = probe.n_init + probe.budget + probe.n_local
    cache, slots = _pool(budget + 1)
    policy = POLICIES[name](cache)
    q = torch.randn(1 if decode else 3, 4, 8)
    whole = step(policy, slots[:budget], decode=decode, seq_id=1, q=q)
    assert torch.equal(whole.slots, slots[:budget])
    assert whole.positions.tolist() == list(range(budget)) and whole.q_positions.tolist() == list(
        range(budget, budget + q.shape[0]))
    # the whole table is full attention's list, graph-ready as full attention is
    assert policy.graph_ready(budget)
    picked = step(policy, slots, decode=decode, seq_id=1, q=q)
    if name == "quest":  # whole pages: at most the budget
        assert policy.budget - policy.page_size < picked.slots.numel() - policy.n_init - policy.n_local <= policy.budget
    else:
        assert picked.slots.numel() == budget
    assert torch.equal(picked.slots[:policy.n_init], slots[:policy.n_init])
    assert torch.equal(picked.slots[-policy.n_local:], slots[budget + 1 - policy.n_local:])
    if name == "tokenselect":
        assert policy.graph_ready(budget + 1)


def test_streaming_attends_everything_up_to_its_window_and_then_drops_the_middle():
    cache, slots = _pool(13)
    policy = StreamingLLM(cache, TORCH, n_init=3, n_local=9)
    q = torch.randn(1, 4, 8)
    assert torch.equal(step(policy, slots[:12], decode=True, seq_id=1, q=q).slots, slots[:12])
    cut = step(policy, slots, decode=True, seq_id=1, q=q).slots
    assert cut.tolist() == slots[:3].tolist() + slots[4:].tolist()


def test_tokenselect_with_k_zero_attends_the_sinks_and_the_window_only():
    cache, slots = _pool(30)
    policy = TokenSelect(cache, TORCH, k=0, n_init=2, n_local=4, theta=None)
    plan = step(policy, slots, decode=True, seq_id=1, q=torch.randn(1, 4, 8))
    assert plan.slots.tolist() == slots[:2].tolist() + slots[-4:].tolist()
    assert plan.positions.tolist() == list(range(6)) and plan.q_positions.tolist() == [6]


def test_infllm_attends_everything_within_its_budget():
    cache, slots = _pool(40)
    policy = InfLLM(cache, TORCH, window=256, chunk=8, k=16, n_init=4, n_local=16, block_size=4, repr_keys=1)
    plan = step(policy, slots[:36], decode=True, seq_id=1, q=torch.randn(1, 4, 8))
    assert torch.equal(plan.slots, slots[:36]) and plan.positions.tolist() == list(range(36))


# ---- the Selection Cache's bookkeeping at its edges ---------------------------------------------------------------

def test_a_fresh_cache_counts_nothing_and_forgets_unknown_sequences():
    cache = SelectionCache(0.5, n_layers=1, width=2)
    assert cache.counts() == (0, 0)  # no row yet: no counters either
    cache.release(12345)  # never seen: nothing to do
    assert cache.row(12345, 8, torch.device("cpu")) == 0


@pytest.mark.parametrize("kernel", ["torch", "triton"])
def test_a_graph_store_into_an_empty_entry_makes_it_valid(kernel):
    """The first decode step of a sequence in a graph: no entry (a miss), the update stores one, and the next
    step with the same query hits it."""
    update = {"torch": selection_update_ref, "triton": selection_update}[kernel]
    cache = SelectionCache(0.9, n_layers=2, width=2, check=CHECKS[kernel], update=update)
    row = cache.row(0, 8, torch.device(DEVICE))
    row_t = torch.tensor(row, device=DEVICE)
    q = torch.arange(1.0, 9.0).view(2, 4).to(DEVICE)
    miss = cache_miss(cache, row_t, 1, q)
    assert bool(miss) and not bool(cache.valid[row, 1])
    out = cache.update(row_t, 1, q, torch.tensor([4, 6], device=DEVICE), miss)
    assert out.tolist() == [4, 6] and bool(cache.valid[row, 1]) and not bool(cache.valid[row, 0])
    torch.testing.assert_close(cache.unit[row, 1], (q.flatten() / q.norm()).float(), atol=1e-7, rtol=0)
    assert not bool(cache_miss(cache, row_t, 1, 2 * q)) and cache.counts() == (1, 1)


def test_the_entries_live_on_the_given_device_in_their_dtypes_and_survive_growth():
    meta = SelectionCache(0.5, n_layers=2, width=3)
    meta.row(0, 8, torch.device("meta"))  # no data: only where and what the arrays are
    arrays = (meta.unit, meta.selection, meta.valid, meta.device_counts)
    assert [t.device.type for t in arrays] == ["meta"] * 4
    assert [t.dtype for t in arrays] == [torch.float32, torch.int64, torch.bool, torch.int64]
    cache = SelectionCache(0.5, n_layers=2, width=3)
    q = torch.arange(1.0, 9.0).view(2, 4)
    cache_store(cache, cache.row(0, 8, torch.device("cpu")), 1, q, torch.tensor([3, 1, 2]))
    for seq in range(1, 9):  # past FIRST_ROWS and then past its double: the arrays grow twice
        cache.row(seq, 8, torch.device("cpu"))
    assert cache.unit.shape[0] >= 9
    got = cache_lookup(cache, 0, 1, q)
    assert got.dtype == torch.int64 and got.tolist() == [3, 1, 2]
    assert cache_lookup(cache, 0, 0, q) is None and cache_lookup(cache, 8, 1, q) is None
    hits, misses = cache.counts()
    assert (hits, misses) == (1, 2) and type(hits) is int and type(misses) is int


# ---- live prefixes of the vote and of InfLLM's block scores ---------------------------------------------------------

@pytest.mark.parametrize("kern", [TORCH, TRITON], ids=["torch", "triton"])
@pytest.mark.parametrize("live", [0, 1, 37, 59, 60])
def test_the_vote_over_a_live_prefix_is_the_vote_over_that_prefix(kern, live):
    """Entries from n_valid on vote -inf; the ones before it get exactly the vote of the prefix alone (live == n:
    the whole list; live == 0: nothing is a candidate)."""
    gen = torch.Generator().manual_seed(live)
    q = torch.randn(4, 16, generator=gen).to(DEVICE)
    k_pool = torch.randn(90, 2, 16, generator=gen).to(DEVICE)
    slots = torch.randperm(90, generator=gen)[:60].to(DEVICE)
    got = kern.head_soft_vote(q, k_pool, slots, 0.5, torch.tensor(live, device=DEVICE)).cpu()
    assert torch.isneginf(got[live:]).all()
    if live:
        torch.testing.assert_close(got[:live], kern.head_soft_vote(q, k_pool, slots[:live], 0.5).cpu(), atol=1e-6,
                                   rtol=1e-5)  # measured: equal to 1e-7
        assert got[:live].sum().item() == pytest.approx(4.0, rel=1e-5)  # one vote per head, shared by the live ones
    assert torch.equal(kern.head_soft_vote(q, k_pool, slots), kern.head_soft_vote(q, k_pool, slots, 1.0))  # default


@pytest.mark.parametrize("kern", [TORCH, TRITON], ids=["torch", "triton"])
@pytest.mark.parametrize("live", [0, 1, 12, 13])
def test_block_scores_over_a_live_prefix(kern, live):
    gen = torch.Generator().manual_seed(live)
    rows = torch.randn(20, 8, generator=gen).to(DEVICE)
    index = torch.randperm(20, generator=gen)[:13].to(DEVICE)
    query = torch.randn(8, generator=gen).to(DEVICE)
    got = kern.block_scores(rows, index, query, torch.tensor(live, device=DEVICE)).cpu()
    assert torch.isneginf(got[live:]).all()
    torch.testing.assert_close(got[:live], (rows[index[:live]] @ query).cpu(), atol=1e-5, rtol=1e-5)


# ---- sparse attention over a graph's live prefix; RMSNorm's epsilon ------------------------------------------------

@pytest.mark.parametrize("kern", [TORCH, TRITON], ids=["torch", "triton"])
@pytest.mark.parametrize("c, live", [(1, 1), (1, 40), (3, 3), (3, 25), (3, 40)])
def test_sparse_attention_over_a_live_prefix_reads_nothing_past_it(kern, c, live):
    """A graph's fixed-length list of 40 of which the first ``live`` are attended (the chunk's own c last among
    them): the rows after them hold NaN and change nothing; the result is the plain call over the prefix."""
    from tokenselect.rope import RopeSpec

    gen = torch.Generator().manual_seed(c * 100 + live)
    n, d = 40, 16
    q = torch.randn(c, 4, d, generator=gen).to(DEVICE)
    k_pool, v_pool = torch.randn(60, 2, d, generator=gen).to(DEVICE), torch.randn(60, 2, d, generator=gen).to(DEVICE)
    slots = torch.randperm(60, generator=gen)[:n].to(DEVICE)
    k_pool[slots[live:]] = float("nan")
    v_pool[slots[live:]] = float("nan")
    key_pos = (torch.randperm(500, generator=gen)[:n] * 3).to(DEVICE)
    q_pos = key_pos[live - c:live]
    inv_freq, scale = RopeSpec(d, theta=10000.0).inv_freq()
    inv_freq = inv_freq.to(DEVICE)
    got = kern.sparse_attention(q, k_pool, v_pool, slots, key_pos, q_pos, inv_freq, scale,
                                n_valid=torch.tensor(live, device=DEVICE))
    want = TORCH.sparse_attention(q, k_pool, v_pool, slots[:live], key_pos[:live], q_pos, inv_freq, scale)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)  # fp32; measured up to 1e-6
    # the scale's default is 1
    assert torch.equal(TORCH.sparse_attention(q, k_pool, v_pool, slots[:live], key_pos[:live], q_pos, inv_freq), want)


@pytest.mark.parametrize("eps", [1e-6, 0.5])
def test_rms_norm_reference_is_the_formula(eps):
    from tokenselect.kernels.rms_norm import rms_norm_ref

    x = torch.tensor([[0.1, -0.2, 0.3, 0.05], [3.0, 4.0, 0.0, 0.0]], dtype=torch.float64)
    w = torch.tensor([1.0, 2.0, 0.5, -1.0], dtype=torch.float64)
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w
    torch.testing.assert_close(rms_norm_ref(x.float(), w.float(), eps).double(), want, atol=1e-6, rtol=1e-6)


def test_host_memory_available_reads_memavailable(monkeypatch, tmp_path):
    """The offloaded V pool is sized from MemAvailable (page cache that can be dropped counts), not from free pages."""
    import builtins

    from tokenselect import kv_cache

    fake = tmp_path / "meminfo"
    fake.write_text("MemTotal:       16000000 kB\nMemFree:          100000 kB\nMemAvailable:    1234567 kB\n")
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: real_open(fake if path == "/proc/meminfo" else path,
                                                                           *a, **k))
    assert kv_cache.host_memory_available() == 1234567 * 1024


def test_host_memory_available_falls_back_to_free_pages_without_proc_meminfo(monkeypatch, tmp_path):
    """Not Linux (no /proc/meminfo), or a meminfo without MemAvailable: free pages times the page size."""
    import builtins

    from tokenselect import kv_cache

    pages = {"SC_AVPHYS_PAGES": 1000, "SC_PAGE_SIZE": 4096}
    monkeypatch.setattr(kv_cache.os, "sysconf", lambda name: pages[name])
    real_open = builtins.open

    def no_meminfo(path, *a, **k):
        if path == "/proc/meminfo":
            raise FileNotFoundError(path)
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", no_meminfo)
    assert kv_cache.host_memory_available() == 1000 * 4096
    old = tmp_path / "meminfo"  # a kernel older than 3.14 writes no MemAvailable line
    old.write_text("MemTotal:       16000000 kB\nMemFree:          100000 kB\n")
    monkeypatch.setattr(builtins, "open", lambda path, *a, **k: real_open(old if path == "/proc/meminfo" else path,
                                                                           *a, **k))
    assert kv_cache.host_memory_available() == 1000 * 4096


def test_silu_mul_reference_splits_the_last_dimension():
    from tokenselect.kernels.silu_mul import silu_mul_ref

    gate_up = torch.randn(2, 4, 6, generator=torch.Generator().manual_seed(0))  # [batch, rows, 2 * width]
    want = torch.nn.functional.silu(gate_up[..., :3]) * gate_up[..., 3:]
    torch.testing.assert_close(silu_mul_ref(gate_up), want, atol=0, rtol=0)


def test_soft_vote_and_hard_vote_choose_differently_where_they_should():
    """Two heads, three tokens, k = 1: each head's own top token is a different one (a tie of counts), while the
    token both heads rank a close second has the largest summed softmax: soft vote picks it, hard vote never."""
    keys = torch.zeros(3, 2, 2)
    keys[:, 0, 0] = torch.tensor([10.0, 9.9, 0.0])  # head 0 reads kv head 0's first dimension
    keys[:, 1, 1] = torch.tensor([0.0, 9.9, 10.0])  # head 1 reads kv head 1's second dimension
    cache = KVCache(1, 3, 2, 2, torch.float32, torch.device("cpu"))
    slots = cache.allocate(3)
    cache.write(0, slots, keys, torch.zeros_like(keys))
    q = torch.eye(2)
    pick = {s: TokenSelect(cache, TORCH, k=1, selector=s).top(q, cache.k[0], slots).tolist()
            for s in ("soft_vote", "hard_vote", "topk")}
    assert pick["soft_vote"] == [1] and pick["hard_vote"] in ([0], [2]) and pick["topk"] == [1]


@pytest.mark.parametrize("selector", ["soft_vote", "hard_vote", "topk"])
@pytest.mark.parametrize("live", [1, 17, 29, 30])
def test_votes_over_a_live_prefix(selector, live):
    """A graph's fixed-length middle: only middle[:live] are candidates, the rest vote -inf; the live ones get the
    votes of the prefix alone (for hard_vote while k <= live)."""
    cache, slots = _pool(30)
    policy = TokenSelect(cache, TORCH, k=1, selector=selector, score_scale=0.7)
    query = torch.randn(4, 8, generator=torch.Generator().manual_seed(live))
    got = policy.votes(query, cache.k[0], slots, torch.tensor(live))
    assert torch.isneginf(got[live:]).all() and torch.isfinite(got[:live]).all()
    torch.testing.assert_close(got[:live], policy.votes(query, cache.k[0], slots[:live]), atol=1e-6, rtol=1e-6)


def test_the_offloaded_value_pool_fits_when_it_needs_exactly_the_available_memory(monkeypatch):
    from tokenselect import kv_cache

    need = 2 * 16 * 2 * 8 * 4  # n_layers * n_slots * n_kv * head_dim * fp32
    monkeypatch.setattr(kv_cache, "host_memory_available", lambda: need)
    assert KVCache(2, 16, 2, 8, torch.float32, torch.device("cpu"), "values").v.numel() * 4 == need
    monkeypatch.setattr(kv_cache, "host_memory_available", lambda: need - 1)
    with pytest.raises(kv_cache.HostMemoryError, match="needs 0.0 GiB of host memory for 16 tokens"):
        KVCache(2, 16, 2, 8, torch.float32, torch.device("cpu"), "values")

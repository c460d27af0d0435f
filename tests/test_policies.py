"""TokenSelect and ReAttention: agreement with full attention, what they select, where they place it."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from tokenselect import LLM, SamplingParams
from tokenselect.kernels import get_kernels
from tokenselect.kv_cache import KVCache
from tokenselect.policies import make_policy
from tokenselect.policies.base import ALL, SELECT, SelectivePolicy
from tokenselect.policies.reattention import ReAttention
from tokenselect.policies.tokenselect import TokenSelect

from policy_steps import cache_with_keys, step

TORCH = get_kernels("torch")


# ---- agreement with full attention ----------------------------------------------------------------

@pytest.mark.parametrize("attention,settings", [
    ("tokenselect", dict(k=4096, n_init=4, n_local=32)),
    ("reattention", dict(n_init=4, n_local=64, span=8, n_spans=40)),
])
def test_budget_covering_context_equals_full(tiny_llama, attention, settings):
    ids = torch.randint(2, 300, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    full = LLM(tiny_llama, chunk_size=32).prompt_logits(ids)
    sparse = LLM(tiny_llama, attention, chunk_size=32, **settings).prompt_logits(ids)
    torch.testing.assert_close(sparse, full, atol=1e-5, rtol=1e-5)


# ---- what the selectors choose ---------------------------------------------------------------------

def loud_head_cache():
    """Heads 0-2 agree on tokens 3 and 7 (logit 6); head 3 shouts for token 12 (logit 50)."""
    d, t = 8, 20
    q = torch.zeros(4, d)
    q[:, 0] = 1.0
    q[3, 0] = 10.0
    keys = torch.zeros(t, 4, d)
    keys[:, :, 1] = torch.randn(t, 4)  # orthogonal to q: noise that scores 0
    keys[[3, 7], :3, 0] = 6.0
    keys[12, 3, 0] = 5.0  # head 3: logit 50 for token 12
    keys[[3, 7], 3, 0] = 0.5  # ... and 5 for tokens 3, 7
    return q, keys


def test_soft_vote_gives_each_head_one_vote():
    q, keys = loud_head_cache()
    cache, slots = cache_with_keys(keys)
    soft = TokenSelect(cache, TORCH, k=2, selector="soft_vote")
    assert soft.top(q, cache.k[0], slots).tolist() == [3, 7]


def test_plain_topk_is_dominated_by_the_loud_head():
    q, keys = loud_head_cache()
    cache, slots = cache_with_keys(keys)
    plain = TokenSelect(cache, TORCH, k=1, selector="topk")
    assert plain.top(q, cache.k[0], slots).tolist() == [12]


@pytest.mark.parametrize("n_kv", [1, 2, 4])
def test_hard_vote_matches_brute_force_count(n_kv):
    torch.manual_seed(n_kv)
    n_heads, d, t, k = 4, 16, 60, 5
    q, keys = torch.randn(n_heads, d), torch.randn(t, n_kv, d)
    cache, slots = cache_with_keys(keys)
    policy = TokenSelect(cache, TORCH, k=k, selector="hard_vote")
    chosen = policy.top(q, cache.k[0], slots)
    counts = torch.zeros(t)
    for h in range(n_heads):
        kv = h // (n_heads // n_kv)
        scores = torch.stack([q[h] @ keys[i, kv] for i in range(t)])
        for i in torch.topk(scores, k).indices:
            counts[i] += 1
    others = torch.ones(t, dtype=torch.bool)
    others[chosen] = False
    assert chosen.numel() == k
    assert counts[chosen].min() >= counts[others].max()
    assert counts[chosen].sum() == torch.topk(counts, k).values.sum()


@pytest.mark.parametrize("attention", ["tokenselect", "reattention"])
def test_selection_ranks_by_the_fp8_selection_keys(attention):
    """With select_dtype fp8 the policies that score every key rank by the e4m3 copy: token 10's key (1.07, 0)
    is (1.125, 0) there and outscores token 25's (0.53, 0.57) -> (0.5, 0.5625), which wins at full precision
    (1.10 against 1.07). The other tokens score <= 0."""
    t = 40
    keys = torch.zeros(t, 1, 2)
    keys[:, 0, 0] = torch.linspace(-1, 0, t)
    keys[10, 0] = torch.tensor([1.07, 0.0])
    keys[25, 0] = torch.tensor([0.53, 0.57])
    q = torch.ones(1, 1, 2)  # a decode step's query, one head
    for select_dtype, want in ((None, 25), (torch.float8_e4m3fn, 10)):
        cache, slots = cache_with_keys(keys, select_dtype)
        if attention == "tokenselect":
            policy = TokenSelect(cache, TORCH, k=1, n_init=2, n_local=4, theta=None)
        else:
            policy = ReAttention(cache, TORCH, window=16, n_init=2, n_local=4, span=1, n_spans=1, chunk=1)
        seen = step(policy, slots, q, decode=True)
        assert seen.slots.tolist() == slots[[0, 1, want, 36, 37, 38, 39]].tolist()


def test_chunk_selects_with_its_mean_query():
    """Prefill selects once per chunk with the mean query: a token aligned with the mean wins even
    though no single query of the chunk points at it."""
    d, t = 4, 40
    keys = torch.zeros(t, 1, d)
    keys[:, 0, 3] = torch.linspace(-1, 1, t)
    keys[10, 0] = torch.tensor([1.0, 1.0, 0.0, 0.0])  # mean of the two queries points here
    keys[20, 0] = torch.tensor([1.6, -1.0, 0.0, 0.0])
    keys[30, 0] = torch.tensor([-1.0, 1.6, 0.0, 0.0])
    cache, slots = cache_with_keys(keys)
    q = torch.tensor([[[1.0, 0.0, 0.0, 0.0]], [[0.0, 1.0, 0.0, 0.0]]])  # [c=2, H=1, d]
    policy = TokenSelect(cache, TORCH, k=1, n_init=0, n_local=0, selector="topk")
    assert step(policy, slots, q, decode=False).slots.tolist() == [slots[10].item()]



def test_an_eager_step_prepares_room_for_its_own_tokens():
    """``start_steps`` gives a policy's ``prepare`` the step's capacity, its cached tokens and its own (t + w): what
    InfLLM and QUEST reserve their blocks and bounds for."""
    cache, slots = cache_with_keys(torch.randn(40, 2, 8))
    policy = TokenSelect(cache, TORCH, k=4, n_init=2, n_local=4)
    capacities = []
    prepare = policy.prepare
    policy.prepare = lambda *a: capacities.append(a[3]) or prepare(*a)
    step(policy, slots, decode=False, q=torch.randn(5, 4, 8))
    step(policy, slots[:30], decode=True, q=torch.randn(1, 4, 8))
    assert capacities == [45, 31]

# ---- placement -------------------------------------------------------------------------------------

def plan_for(positions: str, t: int = 500, c: int = 3):
    torch.manual_seed(0)
    cache, slots = cache_with_keys(torch.randn(t, 2, 16))
    policy = TokenSelect(cache, TORCH, k=40, n_init=8, n_local=16, positions=positions)
    return step(policy, slots, torch.randn(c, 4, 16), decode=False, seq_id=1), slots, policy


def test_reindexed_positions_stay_inside_the_window():
    plan, slots, policy = plan_for("reindex")
    n = policy.n_init + policy.k + policy.n_local
    assert plan.slots.numel() == n
    assert plan.positions.tolist() == list(range(n))
    assert plan.q_positions.tolist() == [n, n + 1, n + 2]
    # sinks first, then the selection in original order, then the local window
    order = plan.order(slots)
    assert order[:8] == list(range(8)) and order[-16:] == list(range(484, 500))
    assert order == sorted(order) and len(set(order)) == n


def test_a_budget_larger_than_the_window_lists_every_chosen_token():
    """k = 8 chosen tokens beside a window of 2 and one own token (the frame around the choice shorter than the
    choice): the list holds exactly the 8 loudest middle tokens, between the sinks and the window."""
    torch.manual_seed(9)
    t, d = 120, 16
    keys = 0.01 * torch.randn(t, 2, d)
    q = torch.randn(1, 4, d)
    loud = [10, 23, 37, 50, 64, 71, 88, 99]
    for i, token in enumerate(loud):
        keys[token] = (3.0 + i) * q[0].view(2, 2, d).mean(1)
    cache, slots = cache_with_keys(keys)
    policy = TokenSelect(cache, TORCH, k=8, n_init=2, n_local=2, theta=None)
    order = step(policy, slots, q, decode=True).order(slots)
    assert order == [0, 1] + loud + [t - 2, t - 1]


def test_original_positions_are_cache_positions():
    plan, slots, _ = plan_for("original")
    assert plan.positions.tolist() == plan.order(slots)
    assert plan.q_positions.tolist() == [500, 501, 502]


def test_positions_never_exceed_the_window_during_generation(tiny_llama):
    """A prompt 4x the model window (256): every list of every layer stays inside the window. Eager steps: a
    whole-step graph calls ``attend`` only while it records, with lists of the graph's fixed length."""
    llm = LLM(tiny_llama, "tokenselect", chunk_size=32, k=64, n_init=4, n_local=32, cuda_graphs=False)
    seen = []
    attend = llm.policy.attend
    llm.policy.attend = lambda *a: seen.append(attend(*a)) or seen[-1]
    ids = torch.randint(2, 300, (1024,), generator=torch.Generator().manual_seed(1)).tolist()
    llm.generate([ids], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert max(int(torch.cat([a.key_pos, a.q_pos]).max()) for a in seen) < llm.window
    assert min(a.slots.numel() for a in seen[-4:]) == 4 + 64 + 32 + 1  # the decode token's own slot last


# ---- Selection Cache --------------------------------------------------------------------------------

def decode_with(tiny_llama, theta, n_new=6):
    llm = LLM(tiny_llama, "tokenselect", chunk_size=32, k=32, n_init=4, n_local=16, theta=theta)
    ids = torch.randint(2, 300, (300,), generator=torch.Generator().manual_seed(5)).tolist()
    out = llm.generate([ids], SamplingParams(max_tokens=n_new, temperature=0, ignore_eos=True))
    return out[0].token_ids, llm.stats()


def test_selection_cache_theta_one_never_hits_and_matches_cache_off(tiny_llama):
    tokens, stats = decode_with(tiny_llama, theta=1.0)
    off_tokens, off_stats = decode_with(tiny_llama, theta=None)
    n_layers, decode_steps = 2, 5  # the first new token comes from the prefill
    assert stats["selection_cache_hits"] == 0
    assert stats["selection_cache_misses"] == n_layers * decode_steps
    assert off_stats["selection_cache_hits"] == off_stats["selection_cache_misses"] == 0
    assert tokens == off_tokens


def test_selection_cache_theta_minus_one_always_hits_after_first(tiny_llama):
    _, stats = decode_with(tiny_llama, theta=-1.0)
    n_layers, decode_steps = 2, 5
    assert stats["selection_cache_misses"] == n_layers
    assert stats["selection_cache_hits"] == n_layers * (decode_steps - 1)
    assert stats["selection_cache_hit_rate"] == pytest.approx(4 / 5)


def test_selection_cache_reuses_the_stored_selection():
    torch.manual_seed(0)
    cache, slots = cache_with_keys(torch.randn(300, 2, 16))
    policy = TokenSelect(cache, TORCH, k=16, n_init=4, n_local=8, theta=0.5)
    q = torch.randn(1, 4, 16)
    first = step(policy, slots, q, decode=True, seq_id=7)
    near = step(policy, slots, q + 0.01 * torch.randn_like(q), decode=True, seq_id=7)
    far = step(policy, slots, -q, decode=True, seq_id=7)
    assert torch.equal(first.slots, near.slots)
    assert policy.selection_cache.counts() == (1, 2)
    assert not torch.equal(first.slots, far.slots)
    policy.release(7)
    step(policy, slots, q, decode=True, seq_id=7)
    assert policy.selection_cache.counts()[1] == 3


def test_a_hit_gives_the_vote_and_the_top_k_no_live_candidate():
    """A decode step's Selection Cache decision gates the work: on a miss the vote and the top-k see the live middle,
    on a hit none of it (their kernels read nothing; the cached choice is returned)."""
    torch.manual_seed(0)
    cache, slots = cache_with_keys(torch.randn(300, 2, 16))
    seen = []  # the live count each kernel was given, in call order

    def vote(query, k_pool, middle, scale, live):
        seen.append(("vote", int(live)))
        return TORCH.head_soft_vote(query, k_pool, middle, scale, live)

    def topk(scores, k, n_valid=None, values=None, out=None):
        seen.append(("topk", int(n_valid)))
        return TORCH.topk(scores, k, n_valid, values, out)

    kernels = dataclasses.replace(TORCH, head_soft_vote=vote, topk=topk)
    policy = TokenSelect(cache, kernels, k=16, n_init=4, n_local=8, theta=0.5)
    q = torch.randn(1, 4, 16)
    first = step(policy, slots, q, decode=True, seq_id=7)
    live = 300 - 4 - 8  # the middle: past the sinks, before the window
    assert seen == [("vote", live), ("topk", live)]
    again = step(policy, slots, q, decode=True, seq_id=7)
    assert policy.selection_cache.counts() == (1, 1)
    assert seen[2:] == [("vote", 0), ("topk", 0)] and torch.equal(first.slots, again.slots)


# ---- ReAttention ------------------------------------------------------------------------------------

@pytest.mark.parametrize("neighbours", [0, 3])
def test_tokenselect_neighbours_select_the_run_around_the_best_voted_token(neighbours):
    """Every head votes for token 100 (decode): with neighbours 3 and k 7 the choice is tokens 97-103, the run of
    tokens within 3 of it; without, token 100 and six others on their own votes."""
    torch.manual_seed(6)
    t, d, n_init, n_local = 200, 16, 4, 20
    keys = 0.01 * torch.randn(t, 2, d)
    q = torch.randn(1, 4, d)
    keys[100] = loud_along(q, 5.0)
    cache, slots = cache_with_keys(keys)
    policy = TokenSelect(cache, TORCH, k=7, n_init=n_init, n_local=n_local, theta=None, dense_until=0,
                         neighbours=neighbours)
    order = step(policy, slots, q, decode=True).order(slots)
    chosen = order[n_init:n_init + 7]
    assert order[:n_init] == list(range(n_init)) and order[n_init + 7:] == list(range(t - n_local, t))
    if neighbours:
        assert chosen == list(range(97, 104))
    else:
        assert 100 in chosen and chosen != list(range(97, 104))


def test_tokenselect_neighbours_stop_at_the_live_middles_end():
    """The best-voted token is the middle's last live one (179): its run holds the 4 live tokens 176-179, never the
    entries past the live middle (the local window's, attended once as the window), and the choice has no repeat."""
    torch.manual_seed(7)
    t, d, n_init, n_local = 200, 16, 4, 20
    keys = 0.01 * torch.randn(t, 2, d)
    q = torch.randn(1, 4, d)
    keys[t - n_local - 1] = loud_along(q, 5.0)
    keys[t - n_local] = loud_along(q, 10.0)  # the window's first key: louder, but not a candidate
    cache, slots = cache_with_keys(keys)
    policy = TokenSelect(cache, TORCH, k=7, n_init=n_init, n_local=n_local, theta=None, dense_until=0, neighbours=3)
    order = step(policy, slots, q, decode=True).order(slots)
    chosen = order[n_init:n_init + 7]
    assert set(range(176, 180)) <= set(chosen) and max(chosen) == 179
    assert len(order) == len(set(order))


def test_tokenselect_neighbours_reach_the_policy_and_a_batch_decodes_as_each_request_alone(tiny_llama,
                                                                                           batch_invariant_matmuls):
    """``neighbours`` from the engine's settings reaches the policy; four requests decoding together (the batch's
    vote in one call, then the spread) make the tokens each makes alone."""
    settings = dict(chunk_size=32, k=16, n_init=4, n_local=16, dense_until=0, neighbours=2, theta=0.5)
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = [[(7 * i + 3 * j) % 200 + 1 for j in range(120 + 9 * i)] for i in range(4)]
    llm = LLM(tiny_llama, "tokenselect", **settings)
    assert llm.policy.neighbours == 2
    together = [o.token_ids for o in llm.generate(prompts, params)]
    alone = [LLM(tiny_llama, "tokenselect", **settings).generate([p], params)[0].token_ids for p in prompts]
    assert together == alone


def test_reattention_widens_winners_into_spans():
    torch.manual_seed(0)
    t, d = 400, 16
    keys = 0.01 * torch.randn(t, 2, d)
    q = torch.randn(2, 4, d)  # chunk of 2 queries
    keys[150] = 5 * q[0].view(2, 2, d).mean(1)  # every head of query 0 votes for token 150
    keys[300] = 5 * q[1].view(2, 2, d).mean(1)  # ... and of query 1 for token 300
    cache, slots = cache_with_keys(keys)
    policy = ReAttention(cache, TORCH, window=1000, n_init=4, n_local=20, span=8, n_spans=2, chunk=2)
    plan = step(policy, slots, q, decode=False)
    order = plan.order(slots)
    assert order == list(range(4)) + list(range(146, 154)) + list(range(296, 304)) + list(range(380, 400))
    assert plan.positions.tolist() == list(range(len(order)))
    assert plan.q_positions.tolist() == [len(order), len(order) + 1]


def test_reattention_merges_overlapping_spans_and_closes_up_the_list():
    """Two winners 2 apart: their spans of 8 overlap into 10 tokens, fewer than the budget of 16; the list closes
    up (the window follows the spans at once, at the next positions) and attends 4 + 10 + 20 entries."""
    torch.manual_seed(0)
    t, d = 400, 16
    keys = 0.01 * torch.randn(t, 2, d)
    q = torch.randn(2, 4, d)
    keys[150] = 5 * q[0].view(2, 2, d).mean(1)
    keys[152] = 5 * q[1].view(2, 2, d).mean(1)
    cache, slots = cache_with_keys(keys)
    policy = ReAttention(cache, TORCH, window=1000, n_init=4, n_local=20, span=8, n_spans=2, chunk=2)
    plan = step(policy, slots, q, decode=False)
    order = plan.order(slots)
    assert order == list(range(4)) + list(range(146, 156)) + list(range(380, 400))
    assert plan.positions.tolist() == list(range(34)) and plan.q_positions.tolist() == [34, 35]
    original = ReAttention(cache, TORCH, window=1000, n_init=4, n_local=20, span=8, n_spans=2, chunk=2,
                           positions="original")
    plan = step(original, slots, q, decode=False)
    assert plan.order(slots) == order and plan.positions.tolist() == order and plan.q_positions.tolist() == [400, 401]


def test_reattention_caps_spans_to_the_window():
    cache = KVCache(1, 10, 1, 4, torch.float32, torch.device("cpu"))
    policy = ReAttention(cache, TORCH, window=1024, n_init=32, n_local=512, span=32, n_spans=127, chunk=256)
    assert policy.n_spans == (1024 - 32 - 512 - 256) // 32
    with pytest.raises(ValueError, match="window"):
        ReAttention(cache, TORCH, window=256, n_init=32, n_local=512, chunk=64)


def test_reattention_window_exactly_full_leaves_no_spans():
    """n_init + n_local + chunk == window leaves room for no span: accepted, with a budget of 0 (the list is the
    sinks and the window); one token more is refused."""
    cache = KVCache(1, 10, 1, 4, torch.float32, torch.device("cpu"))
    policy = ReAttention(cache, TORCH, window=100, n_init=10, n_local=60, span=4, n_spans=8, chunk=30)
    assert policy.n_spans == 0 and policy.budget == 0
    assert ReAttention(cache, TORCH, window=101, n_init=10, n_local=60, span=1, n_spans=8, chunk=30).budget == 1
    with pytest.raises(ValueError, match="exceed the model window 99"):
        ReAttention(cache, TORCH, window=99, n_init=10, n_local=60, span=4, n_spans=8, chunk=30)


def loud_along(q: torch.Tensor, scale: float) -> torch.Tensor:
    """A key [n_kv=2, d] that every head of the decode query ``q: [1, 4, d]`` scores highest."""
    return scale * q[0].view(2, 2, -1).mean(1)


def test_reattention_votes_only_for_the_live_middle():
    """Decode: the middle's table span ends with entries that are not its live tokens (the local window's first
    token, at index ``live``); a key there that every head would vote for gets no vote, and the span around the
    middle's own winner is chosen (the local window is attended once, as the window)."""
    torch.manual_seed(4)
    t, d, n_init, n_local = 200, 16, 4, 20
    keys = 0.01 * torch.randn(t, 2, d)
    q = torch.randn(1, 4, d)
    keys[100] = loud_along(q, 2.0)
    keys[t - n_local] = loud_along(q, 10.0)  # the window's first key: louder than any middle key
    cache, slots = cache_with_keys(keys)
    policy = ReAttention(cache, TORCH, window=1000, n_init=n_init, n_local=n_local, span=4, n_spans=1, chunk=1)
    order = step(policy, slots, q, decode=True).order(slots)
    assert order == list(range(n_init)) + list(range(98, 102)) + list(range(t - n_local, t))


def test_reattention_spans_only_around_tokens_with_votes():
    """Three spans allowed, but every head votes for one token (top 1): one span, and no span around the
    unvoted tokens that rank next (the earliest, by the tie-break)."""
    torch.manual_seed(5)
    t, d = 200, 16
    keys = 0.01 * torch.randn(t, 2, d)
    q = torch.randn(1, 4, d)
    keys[120] = loud_along(q, 5.0)
    cache, slots = cache_with_keys(keys)
    policy = ReAttention(cache, TORCH, window=1000, n_init=4, n_local=20, span=4, n_spans=3, chunk=1)
    order = step(policy, slots, q, decode=True).order(slots)
    assert order == list(range(4)) + list(range(118, 122)) + list(range(180, 200))


def test_reattention_with_no_room_for_a_span_attends_the_sinks_and_the_window():
    """A budget of 0 (n_init + n_local + chunk == window): a selecting step attends the sinks and the window only."""
    torch.manual_seed(6)
    t, d = 200, 16
    cache, slots = cache_with_keys(torch.randn(t, 2, d))
    policy = ReAttention(cache, TORCH, window=100, n_init=10, n_local=60, span=4, n_spans=8, chunk=30)
    order = step(policy, slots, torch.randn(1, 4, d), decode=True).order(slots)
    assert order == list(range(10)) + list(range(t - 60, t))


def test_reattention_span_stops_at_the_live_middles_end():
    """The winner is the middle's last live token: its span (w - 2 .. w + 1) is clipped to the live middle, so the
    window's first token (middle index ``live``) is attended once, as the window, not also as the span's end."""
    torch.manual_seed(7)
    t, d, n_init, n_local = 200, 16, 4, 20
    keys = 0.01 * torch.randn(t, 2, d)
    q = torch.randn(1, 4, d)
    w = t - n_local - 1
    keys[w] = loud_along(q, 5.0)
    cache, slots = cache_with_keys(keys)
    policy = ReAttention(cache, TORCH, window=1000, n_init=n_init, n_local=n_local, span=4, n_spans=1, chunk=1)
    order = step(policy, slots, q, decode=True).order(slots)
    assert order == list(range(n_init)) + [w - 2, w - 1, w] + list(range(t - n_local, t))


@pytest.mark.parametrize("top", [1, 2])
def test_reattention_heads_vote_with_their_own_kv_heads(top):
    """GQA, 4 query heads over 2 KV heads, a chunk of 2 queries: heads 0-1 read KV head 0, where only token 60 (then
    61) is loud along their direction; heads 2-3 read KV head 1, where only token 120 (then 121) is. Each query's
    heads vote for their own KV head's tokens (a query's heads reading another query's KV head would vote
    elsewhere): top 1 for 60 and 120, top 2 for 61 and 121 too."""
    torch.manual_seed(8)
    t, d = 200, 16
    keys = 0.01 * torch.randn(t, 2, d)
    q = torch.zeros(2, 4, d)
    q[:, :2, 0], q[:, 2:, 1] = 1.0, 1.0  # heads 0-1 along dimension 0, heads 2-3 along dimension 1
    keys[60, 0, 0], keys[61, 0, 0], keys[120, 1, 1], keys[121, 1, 1] = 5.0, 4.0, 5.0, 4.0
    keys[60:62, 1, 1], keys[120:122, 0, 0] = -5.0, -5.0  # the least liked on the other KV head
    cache, slots = cache_with_keys(keys)
    policy = ReAttention(cache, TORCH, window=1000, n_init=4, n_local=20, span=4, n_spans=2 * top, chunk=2, top=top)
    order = step(policy, slots, q, decode=False).order(slots)
    assert order == list(range(4)) + list(range(58, 61 + top)) + list(range(118, 121 + top)) + list(range(180, 200))


@pytest.mark.parametrize("kernels", ["torch", "triton"])
@pytest.mark.parametrize("top", [1, 2])
@pytest.mark.parametrize("per_block", [1, 3, 16])
def test_reattention_scores_in_blocks_of_queries_as_in_one(monkeypatch, per_block, top, kernels):
    """Every (query, head) pair votes for its ``top`` best keys once: with top 1 in one pass of ``paged_argmax``,
    with more a block of queries at a time (SCORE_ELEMENTS: blocks of 1, of 3 with a partial last one, one block).
    Query i's heads read dimension i, which token 20 + 16 i holds at 5 and token 21 + 16 i at 4: top 1 votes for
    the first, top 2 for both. Every voted token has 4 votes: the winners are the earliest of equal counts, through
    the reference's top-k and the Triton kernel's alike."""
    from tokenselect.policies import reattention

    gen = torch.Generator().manual_seed(3)
    t, d, w = 300, 16, 16
    keys = 0.01 * torch.randn(t, 2, d, generator=gen)
    q = torch.zeros(w, 4, d)
    for i in range(w):
        q[i, :, i] = 1.0
        keys[20 + 16 * i, :, i], keys[21 + 16 * i, :, i] = 5.0, 4.0
    voted = [20 + 16 * i + j for i in range(w) for j in range(top)]  # 4 votes each
    if kernels == "triton" and torch.cuda.is_available():  # compiled Triton kernels read GPU memory only
        keys, q = keys.cuda(), q.cuda()
    cache, slots = cache_with_keys(keys)
    # the earliest 14 of the voted tokens win (a query counted twice would win over them)
    policy = ReAttention(cache, get_kernels(kernels), window=4096, n_init=4, n_local=16, span=4, n_spans=w - 2,
                         chunk=w, top=top)
    monkeypatch.setattr(reattention, "SCORE_ELEMENTS", 4 * (t + w - 4 - 16) * per_block)  # heads x middle x queries
    order = step(policy, slots, q, decode=False).order(slots)
    covered = sorted({x for token in voted[:w - 2] for x in range(token - 2, token + 2)})
    assert order == list(range(4)) + covered + list(range(284, 300))


# ---- end to end --------------------------------------------------------------------------------------

@pytest.mark.parametrize("attention", ["full", "tokenselect", "reattention"])
def test_prompt_four_times_the_window_generates(tiny_llama, attention):
    llm = LLM(tiny_llama, attention, chunk_size=64)
    ids = torch.randint(2, 300, (1024,), generator=torch.Generator().manual_seed(9)).tolist()
    out = llm.generate([ids], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 5 and out[0].finish_reason == "length"
    assert llm.scheduler.available == llm.cache.n_slots  # everything released


def test_defaults_fit_small_windows(tiny_llama):
    llm = LLM(tiny_llama, "tokenselect")  # window 256: paper sizes scaled by 256/8192
    p = llm.policy
    assert (p.n_init, p.k, p.n_local) == (4, 64, 16)
    assert p.n_init + p.k + p.n_local + llm.chunk_size <= llm.window
    with pytest.raises(ValueError, match=r"^attention 'full' takes no setting k \(it takes: none\)$"):
        make_policy("full", llm.cache, TORCH, 256, 64, {"k": 3})
    with pytest.raises(ValueError, match=r"^unknown attention 'fast'; choose from full, tokenselect, reattention, "
                                         r"streaming, infllm, quest$"):
        make_policy("fast", llm.cache, TORCH, 256, 64)


@pytest.mark.parametrize("bad, message", [
    (dict(positions="absolute"), "positions must be one of reindex, original, not 'absolute'"),
    (dict(n_init=-1), "n_init, n_local and the selection budget must be >= 0"),
    (dict(n_local=-1), "n_init, n_local and the selection budget must be >= 0"),
    (dict(budget=-1), "n_init, n_local and the selection budget must be >= 0")])
def test_the_selective_base_refuses_what_its_list_cannot_hold(bad, message):
    """SelectivePolicy's own checks, for a policy whose values did not come through a settings dataclass (a new
    policy under development): each bad value, alone, gets its message."""
    cache = KVCache(1, 8, 1, 4, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        SelectivePolicy(cache, TORCH, **(dict(n_init=1, n_local=1, budget=1) | bad))


SMALL = {  # sizes at which each selective policy selects from a few dozen tokens on (dense_until 0)
    "tokenselect": dict(k=16, n_init=4, n_local=16),
    "streaming": dict(n_init=4, n_local=16),
    "quest": dict(k=16, n_init=4, n_local=16, page_size=4),
    "reattention": dict(n_init=4, n_local=16, span=4, n_spans=4),
    "infllm": dict(k=16, n_init=4, n_local=16, block_size=4),
}


@pytest.mark.parametrize("attention", list(SMALL))
def test_selective_policies_attend_densely_up_to_the_window_and_select_past_it(tiny_llama, attention):
    """``dense_until`` defaults to the model's window (256 here) for every selective policy: a step whose last
    position is inside it attends every token as full attention does (equality included), one past it selects.
    A 300-token prompt's logits are full attention's at positions 0-255 and differ after; with ``dense_until=0``
    (the papers) they differ inside the window too. InfLLM's local-score ring holds the 252 tokens past the sinks
    that its first selecting chunk closes into blocks at once."""
    llm = LLM(tiny_llama, attention, chunk_size=32, **SMALL[attention])
    policy = llm.policy
    assert policy.dense_until == llm.window == 256
    assert llm.policy_config["dense_until"] == 256  # what the results record
    assert policy.mode(255, 1) == ALL and policy.mode(224, 32) == ALL  # last position 255: inside
    assert policy.mode(256, 1) == SELECT and policy.mode(225, 32) == SELECT  # one past the window
    assert policy.mode(20, 1) == ALL  # below n_init + budget + n_local the list holds everything anyway
    assert policy.selection_threshold == 256  # the window dominates: a decode step after 256 cached tokens selects
    ids = torch.randint(2, 300, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    dense = llm.prompt_logits(ids)
    llm.set_attention("full")
    full = llm.prompt_logits(ids)
    torch.testing.assert_close(dense[:256], full[:256], atol=1e-5, rtol=0)
    assert (dense[256:] - full[256:]).abs().amax(dim=-1).min() > 1e-3  # every position past the window selects
    llm.set_attention(attention, dense_until=0, **SMALL[attention])  # the paper: selects from a few dozen on
    assert llm.policy.dense_until == 0 and llm.policy.mode(255, 1) == SELECT
    assert (llm.prompt_logits(ids[:200]) - full[:200]).abs().max() > 1e-3
    llm.set_attention(attention, **SMALL[attention])
    out = llm.generate([ids], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 4
    with pytest.raises(ValueError, match="dense_until must be >= 0"):
        llm.set_attention(attention, dense_until=-1)


# ---- small helpers the engine and the benchmarks rely on (issue #34's mutation check) ---------------------------

def test_default_chunk_is_512_or_a_quarter_of_a_small_window_and_at_least_16():
    from tokenselect.policies import default_chunk

    windows = [32, 64, 68, 130, 256, 2048, 2052, 8192, 1 << 20]
    chunks = [default_chunk(w) for w in windows]
    assert chunks == [16, 16, 17, 32, 64, 512, 512, 512, 512]
    assert all(type(c) is int for c in chunks)
    # four chunks' worth for a policy choosing per group of queries, where the group is no longer than the chunk
    assert [default_chunk(w, 512) for w in windows] == [16, 16, 17, 32, 64, 2048, 2048, 2048, 2048]
    assert [default_chunk(w, 16) for w in windows] == [64, 64, 68, 128, 256, 2048, 2048, 2048, 2048]
    assert default_chunk(8192, 513) == 512 and default_chunk(8192, 0) == 512


def test_the_engine_prefills_tokenselect_in_four_groups_a_chunk_by_default(tiny_llama):
    """tiny_llama's window of 256: chunks of 64; TokenSelect's with groups of 16 take 4 of them, and its default
    groups of 512 are longer than a chunk: 64. Other policies, and an explicit chunk, are left as they are."""
    from tokenselect import LLM

    assert LLM(tiny_llama, "tokenselect", prefill_group=16).chunk_size == 256
    assert LLM(tiny_llama, "tokenselect").chunk_size == 64
    assert LLM(tiny_llama, "tokenselect", prefill_group=0).chunk_size == 64
    assert LLM(tiny_llama, "tokenselect", prefill_group=16, chunk_size=100).chunk_size == 100
    assert LLM(tiny_llama, "quest").chunk_size == 64


def test_policy_stats_add_subtract_and_give_the_hit_rate():
    from tokenselect.policies import PolicyStats

    a, b = PolicyStats(3, 5), PolicyStats(1, 7)
    assert a + b == PolicyStats(4, 12) and (a + b) - b == a and a - b == PolicyStats(2, -2)
    assert PolicyStats().selection_cache_hit_rate == 0.0 and PolicyStats(0, 4).selection_cache_hit_rate == 0.0
    assert a.selection_cache_hit_rate == 3 / 8
    assert a.as_dict() == {"selection_cache_hits": 3, "selection_cache_misses": 5, "selection_cache_hit_rate": 3 / 8}


def test_start_step_gives_the_policy_the_queries_dtype():
    """InfLLM keeps a prefill chunk's queries in a buffer made in their dtype (bf16 on a GPU), not the default."""
    from tokenselect.policies import start_step

    cache = KVCache(1, 64, 2, 8, torch.float32, torch.device("cpu"))
    policy = make_policy("infllm", cache, TORCH, window=256, chunk=16)
    start_step(policy, 0, cache.allocate(16), 0, 16, False, (16, 4, 8), torch.bfloat16)
    assert policy.step_buffers(0)[0].dtype == torch.bfloat16 and policy.step_buffers(0)[0].shape == (1, 16, 4, 8)


def test_full_attention_runs_as_a_graph_unless_the_values_are_on_the_host():
    from tokenselect.policies import FullAttention

    on_device = KVCache(1, 16, 2, 8, torch.float32, torch.device("cpu"))
    offloaded = KVCache(1, 16, 2, 8, torch.float32, torch.device("cpu"), offload="values")
    assert FullAttention(on_device, TORCH).graph_ready(0, 1) and FullAttention(on_device, TORCH).graph_ready(100, 512)
    assert not FullAttention(offloaded, TORCH).graph_ready(0, 1) and not FullAttention(offloaded, TORCH).graph_ready(100)


def test_a_selective_policy_runs_as_a_graph_while_it_selects_or_with_the_values_on_the_device():
    """While it attends every token its list is full attention's, so with the values on the host it is not
    graph-ready (as full attention); once it selects (1 + 4 + 1 tokens fit, 100 do not) it is, either way."""
    on_device = KVCache(1, 16, 2, 8, torch.float32, torch.device("cpu"))
    offloaded = KVCache(1, 16, 2, 8, torch.float32, torch.device("cpu"), offload="values")
    for cache in (on_device, offloaded):
        policy = TokenSelect(cache, TORCH, k=4, n_init=1, n_local=1)
        assert policy.mode(5, 1) == ALL and policy.mode(100, 1) == SELECT
        assert policy.graph_ready(100, 1)
        assert policy.graph_ready(5, 1) == (cache is on_device)


def test_selection_threshold_is_the_first_length_whose_steps_select():
    """``selection_threshold``: a decode step after that many cached tokens selects, one after one fewer attends
    every token, whether the list's capacity (1 + 4 + 1 tokens: 7) or ``dense_until`` (40) sets it; full attention
    never selects."""
    from tokenselect.policies.full import FullAttention
    cache = KVCache(1, 16, 2, 8, torch.float32, torch.device("cpu"))
    for dense_until, want in ((0, 7), (7, 7), (40, 40)):
        policy = TokenSelect(cache, TORCH, k=4, n_init=1, n_local=1, dense_until=dense_until)
        assert policy.selection_threshold == want
        assert (policy.mode(want - 1, 1), policy.mode(want, 1), policy.mode(want, 8)) == (ALL, SELECT, SELECT)
    assert FullAttention(cache, TORCH).selection_threshold is None


def test_tokenselect_graph_state_is_its_selection_cache():
    """What a whole-step graph records and a check run restores: nothing before the first sequence, then the
    Selection Cache's entries and counters themselves (a graph reads them at their addresses)."""
    cache = KVCache(1, 64, 2, 8, torch.float32, torch.device("cpu"))
    policy = TokenSelect(cache, TORCH, k=4, n_init=1, n_local=1)
    assert policy.graph_state() == ()
    policy.prepare(0, cache.allocate(8), 8, 9, True, (1, 4, 8), torch.float32)
    sc = policy.selection_cache
    state = policy.graph_state()
    assert len(state) == 4 and all(a is b for a, b in zip(state, (sc.unit, sc.selection, sc.valid, sc.device_counts)))


def test_score_scale_is_raw_sqrt_d_or_a_number():
    from tokenselect.policies.tokenselect import resolve_score_scale

    assert resolve_score_scale("raw", 64) == 1.0
    assert resolve_score_scale("sqrt_d", 64) == 0.125 and resolve_score_scale("sqrt_d", 16) == 0.25
    assert resolve_score_scale("0.5", 64) == 0.5 and resolve_score_scale(3, 64) == 3.0
    for bad in ("sqrt", "SQRT_D", None):
        with pytest.raises(ValueError, match=rf"^score_scale must be 'raw', 'sqrt_d' or a number, not {bad!r}$"):
            resolve_score_scale(bad, 64)


def test_tokenselect_scales_by_its_head_dim_keeps_an_entry_per_layer_and_frees_rows():
    from tokenselect.kernels import get_kernels

    cache = KVCache(3, 40, 2, 16, torch.float32, torch.device("cpu"))  # 3 layers, 2 kv heads of 16 dimensions
    policy = TokenSelect(cache, TORCH, k=4, n_init=1, n_local=1, score_scale="sqrt_d")
    assert policy.scale == 0.25
    assert policy.selection_cache.n_layers == 3
    slots = cache.allocate(8)
    assert policy.prepare(0, slots, 8, 9, True, (1, 4, 16), torch.float32) == 0
    assert policy.prepare(1, slots, 8, 9, True, (1, 4, 16), torch.float32) == 1
    policy.release(0)
    assert policy.prepare(2, slots, 8, 9, True, (1, 4, 16), torch.float32) == 0  # the released row, reused
    triton = get_kernels("triton")  # the graph store's kernel is the engine's, not the reference
    chosen = TokenSelect(cache, triton, k=4).selection_cache
    assert chosen.check is triton.selection_check and chosen.update_kernel is triton.selection_update


def test_a_new_policy_is_not_recorded_as_a_graph_unless_it_says_so():
    """``AttentionPolicy``'s defaults, which a policy written against the interface inherits: no graph, row 0, no
    state, no counters."""
    from tokenselect.policies import AttentionPolicy

    class Minimal(AttentionPolicy):
        name = "minimal"

    cache = KVCache(1, 16, 2, 8, torch.float32, torch.device("cpu"))
    policy = Minimal(cache, TORCH)
    assert not policy.graph_ready(0) and not policy.graph_ready(10**6, 1)
    assert policy.graph_state() == () and policy.graph_reads() == () and policy.stats() is None

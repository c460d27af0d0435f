"""The baselines: StreamingLLM, InfLLM, QUEST and full attention with RoPE scaling overrides.

Agreement with full attention when the budget covers the context, what each scoring rule selects on
hand-built caches (recomputed here from its definition), where the attended tokens are placed, and
end-to-end generation far past the model window.
"""

from __future__ import annotations

import argparse
import dataclasses
import math

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import _compute_dynamic_ntk_parameters, _compute_yarn_parameters

from tokenselect import LLM, SamplingParams
from tokenselect.kernels import get_kernels
from tokenselect.policies import add_policy_args, policy_kwargs
from tokenselect.policies.base import SeqStep, start_step
from tokenselect.policies.infllm import FIXED, InfLLM
from tokenselect.policies.quest import Quest
from tokenselect.policies.streaming import StreamingLLM

from policy_steps import cache_with_keys, step

TORCH = get_kernels("torch")


def token_order(plan, slots: torch.Tensor) -> list[int]:
    """Token indices of the step's context slots, in attention order."""
    return plan.order(slots)


# ---- agreement with full attention ----------------------------------------------------------------

@pytest.mark.parametrize("attention,settings", [
    ("streaming", dict(n_init=4, n_local=256)),
    ("infllm", dict(k=4096, n_init=4, n_local=32, block_size=16, repr_keys=2)),
    ("quest", dict(k=4096, n_init=4, n_local=16, page_size=16)),
])
def test_budget_covering_context_equals_full(tiny_llama, attention, settings):
    ids = torch.randint(2, 300, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    full = LLM(tiny_llama, chunk_size=32).prompt_logits(ids)
    sparse = LLM(tiny_llama, attention, chunk_size=32, **settings).prompt_logits(ids)
    torch.testing.assert_close(sparse, full, atol=1e-5, rtol=1e-5)


# ---- StreamingLLM -----------------------------------------------------------------------------------

def test_streaming_attends_exactly_sinks_and_window():
    torch.manual_seed(0)
    cache, slots = cache_with_keys(torch.randn(300, 2, 8))
    policy = StreamingLLM(cache, TORCH, n_init=4, n_local=20)
    plan = step(policy, slots, decode=False, seq_id=0, q=torch.randn(3, 4, 8))
    assert token_order(plan, slots) == list(range(4)) + list(range(280, 300))
    assert plan.positions.tolist() == list(range(24))
    assert plan.q_positions.tolist() == [24, 25, 26]
    short = step(policy, slots[:24], decode=True, seq_id=0, q=torch.randn(1, 4, 8))
    assert token_order(short, slots) == list(range(24)) and short.q_positions.tolist() == [24]


def test_streaming_with_original_positions_keeps_the_tokens_own():
    torch.manual_seed(0)
    cache, slots = cache_with_keys(torch.randn(300, 2, 8))
    policy = StreamingLLM(cache, TORCH, n_init=4, n_local=20, positions="original")
    plan = step(policy, slots, decode=False, seq_id=0, q=torch.randn(3, 4, 8))
    assert token_order(plan, slots) == list(range(4)) + list(range(280, 300))
    assert plan.positions.tolist() == list(range(4)) + list(range(280, 300))
    assert plan.q_positions.tolist() == [300, 301, 302]


# ---- QUEST -------------------------------------------------------------------------------------------

def quest_expected(q: torch.Tensor, keys: torch.Tensor, middle: range, page_size: int, n_pages: int) -> list[int]:
    """The pages QUEST's rule picks, from its definition: per page, per head h (kv head h // group),
    sum_c max(q_c * min_c, q_c * max_c) with the chunk-mean query; the best head's bound ranks the page."""
    query = q.mean(dim=0)
    n_heads, n_kv = query.shape[0], keys.shape[1]
    pages = [list(middle[i:i + page_size]) for i in range(0, len(middle), page_size)]
    scores = []
    for page in pages:
        bounds = []
        for h in range(n_heads):
            k = keys[page, h // (n_heads // n_kv)]  # [tokens, d]
            lo, hi = k.min(dim=0).values, k.max(dim=0).values
            bounds.append(sum(max(query[h, c] * lo[c], query[h, c] * hi[c]) for c in range(k.shape[1])))
            best = (k @ query[h]).max()
            assert bounds[-1] >= best - 1e-6 * (1 + best.abs())  # an upper bound (up to fp32 rounding)
        scores.append(max(bounds))
    best = sorted(range(len(pages)), key=lambda p: -scores[p])[:n_pages]
    return [token for p in sorted(best) for token in pages[p]]


def test_quest_selects_the_pages_with_the_highest_bound():
    torch.manual_seed(1)
    t, n_init, n_local, ps = 301, 4, 8, 16  # middle 4..292: 18 full pages and one of a single token
    keys = torch.randn(t, 2, 8)
    cache, slots = cache_with_keys(keys)
    q = torch.randn(3, 4, 8)
    policy = Quest(cache, TORCH, k=3 * ps, page_size=ps, n_init=n_init, n_local=n_local)
    plan = step(policy, slots, decode=False, seq_id=0, q=q)
    chosen = quest_expected(q, keys, range(n_init, t - n_local), ps, 3)
    assert token_order(plan, slots) == list(range(n_init)) + chosen + list(range(t - n_local, t))
    assert plan.positions.tolist() == list(range(plan.slots.numel()))


@pytest.mark.parametrize("partial", [1, 2, 7, 15, 16])
@pytest.mark.parametrize("decode", [False, True])
def test_quest_partial_last_page_competes_with_bounds_from_its_live_keys(partial, decode):
    """The middle ends in a page of ``partial`` live tokens (16: none partial), whose first token holds a key loud
    along the query (bound 40 per |q| unit, half of it from the page's minima on the query's negative dims, half from
    its maxima); a full page holds one of 25. With one page of budget the last page wins only if both its minima and
    its maxima come from its live keys, not from the entries past the live end (here the local window's first key,
    loud against the query). Every choice equals the rule's definition (``quest_expected``)."""
    torch.manual_seed(partial)
    n_init, n_local, ps, full_pages = 3, 5, 16, 6
    t = n_init + full_pages * ps + partial + n_local
    keys = torch.randn(t + 1, 2, 8)
    q = torch.randn(1 if decode else 3, 4, 8)
    along = torch.sign(q.mean(dim=0)[::2])  # [n_kv, d]: heads 0 and 2 read kv heads 0 and 1
    first = n_init + full_pages * ps  # the last page's first token
    keys[first] = 40 * along
    keys[n_init + 2 * ps + 5] = 25 * along  # in full page 2
    keys[t - n_local] = -80 * along  # the local window's first key: not a middle key
    cache, slots = cache_with_keys(keys)
    policy = Quest(cache, TORCH, k=ps, page_size=ps, n_init=n_init, n_local=n_local)
    plan = step(policy, slots[:t], decode=decode, seq_id=0, q=q)
    chosen = quest_expected(q, keys, range(n_init, t - n_local), ps, 1)
    assert first in chosen
    assert token_order(plan, slots) == list(range(n_init)) + chosen + list(range(t - n_local, t))
    assert plan.positions.tolist() == list(range(plan.slots.numel()))


@pytest.mark.parametrize("partial", [1, 7, 15])
@pytest.mark.parametrize("decode", [False, True])
def test_quest_partial_page_bounds_read_neither_the_full_page_before_it_nor_the_entries_after_it(partial, decode):
    """Two pages of budget; the last full page holds a key loud along the query (40), page 2 one of 30, and the
    entry just past the live middle (the local window's first key) one of 80. The partial last page's own keys are
    quiet: its bounds must come from them alone, not from the full page before it nor the entries after it (either
    would lift it over page 2)."""
    torch.manual_seed(10 + partial)
    n_init, n_local, ps, full_pages = 3, 5, 16, 6
    t = n_init + full_pages * ps + partial + n_local
    keys = 0.1 * torch.randn(t, 2, 8)
    q = torch.randn(1 if decode else 3, 4, 8)
    along = torch.sign(q.mean(dim=0)[::2])  # [n_kv, d]: heads 0 and 2 read kv heads 0 and 1
    keys[n_init + 2 * ps + 5] = 30 * along
    keys[n_init + (full_pages - 1) * ps + 3] = 40 * along
    keys[t - n_local] = 80 * along
    cache, slots = cache_with_keys(keys)
    policy = Quest(cache, TORCH, k=2 * ps, page_size=ps, n_init=n_init, n_local=n_local)
    plan = step(policy, slots, decode=decode, seq_id=0, q=q)
    chosen = quest_expected(q, keys, range(n_init, t - n_local), ps, 2)
    assert chosen == list(range(n_init + 2 * ps, n_init + 3 * ps)) + list(
        range(n_init + (full_pages - 1) * ps, n_init + full_pages * ps))
    assert token_order(plan, slots) == list(range(n_init)) + chosen + list(range(t - n_local, t))


def test_quest_chooses_a_partial_last_page_with_no_local_window():
    """n_local = 0: the middle runs to the table's end, and the chosen partial page's entries past it are not
    read (only its 2 live tokens are attended)."""
    torch.manual_seed(3)
    n_init, ps = 2, 8
    t = n_init + 5 * ps + 2
    keys = 0.1 * torch.randn(t, 2, 8)
    q = torch.randn(1, 4, 8)
    keys[t - 1] = 20 * torch.sign(q[0, ::2])
    cache, slots = cache_with_keys(keys)
    policy = Quest(cache, TORCH, k=ps, page_size=ps, n_init=n_init, n_local=0)
    plan = step(policy, slots, decode=True, seq_id=0, q=q)
    assert token_order(plan, slots) == list(range(n_init)) + [t - 2, t - 1]


@pytest.mark.parametrize("dense_until", [0, 30])
def test_quest_kept_bounds_follow_the_rule_step_after_step(dense_until):
    """One sequence decoding from its first selecting step (one full page and a partial one) to 3x longer, a fresh
    query each step: every choice equals the rule's definition, with the bounds kept and extended across steps.
    Page 0 (keys of +-5 in every channel: bound 5 sum|q| for any query) wins until page 5 (+-8) enters the middle;
    the sinks outnumber the window (n_init 8, n_local 2). With dense_until 30 the steps up to token 29 attend every
    token, and the first selecting step bounds the 5 pages filled by then at once."""
    torch.manual_seed(6)
    n_init, n_local, ps, d = 8, 2, 4, 8
    keys = 0.1 * torch.randn(48, 2, d)
    keys[n_init], keys[n_init + 1] = 5.0, -5.0
    keys[n_init + 5 * ps + 1], keys[n_init + 5 * ps + 2] = 8.0, -8.0
    cache, slots = cache_with_keys(keys)
    policy = Quest(cache, TORCH, k=ps, page_size=ps, n_init=n_init, n_local=n_local, dense_until=dense_until)
    winners = []
    for t in range(n_init + ps + n_local + 1, 48):  # the first step that selects: 5 middle tokens
        q = torch.randn(1, 4, d)
        plan = step(policy, slots[:t], decode=True, seq_id=0, q=q)
        if t + 1 <= dense_until:
            assert token_order(plan, slots) == list(range(t)) and policy.pages.get(0, 0) == 0, t
            continue
        chosen = quest_expected(q, keys, range(n_init, t - n_local), ps, 1)
        assert token_order(plan, slots) == list(range(n_init)) + chosen + list(range(t - n_local, t)), t
        winners.append(chosen[0])
    assert winners[0] == n_init and winners[-1] == n_init + 5 * ps


def test_quest_scores_only_the_live_pages_of_its_row():
    """The bounds' page axis has spare capacity (it doubles as it grows): the page-score kernel is told the live
    pages (the partial last one included), so it reads none of the rest, which score -inf. Rows come one a
    sequence."""
    torch.manual_seed(7)
    n_init, n_local, ps = 4, 8, 16
    cache, slots = cache_with_keys(torch.randn(300, 2, 8))
    seen = []
    kernels = dataclasses.replace(TORCH, page_scores=lambda *args: seen.append(args[-1]) or TORCH.page_scores(*args))
    policy = Quest(cache, kernels, k=2 * ps, page_size=ps, n_init=n_init, n_local=n_local, dense_until=0)
    step(policy, slots, decode=True, seq_id=0, q=torch.randn(1, 4, 8))
    live_pages = -(-(300 - n_init - n_local) // ps)  # 18: 17 full, a partial one
    assert policy.lo.shape[2] > live_pages and seen and all(int(n) == live_pages for n in seen)
    assert policy.lo.shape[0] == 1  # one sequence, one row of bounds (they are large: no spare rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_quest_bounds_of_every_layer_are_each_page_s_channel_minimum_and_maximum(dtype):
    """A sequence that starts selecting with 14 full pages cached, then 2 more: each page's bounds, in every layer,
    are its keys' channel-wise minimum and maximum (in fp32)."""
    from tokenselect.kv_cache import KVCache

    torch.manual_seed(3)
    layers, n, ps, n_init, n_local = 3, 80, 4, 4, 8
    cache = KVCache(layers, n, 2, 8, dtype, torch.device("cpu"))
    slots = cache.allocate(n)[torch.randperm(n)]
    keys = torch.randn(layers, n, 2, 8).to(dtype)
    for layer in range(layers):
        cache.write(layer, slots, keys[layer], keys[layer])
    policy = Quest(cache, TORCH, k=ps, page_size=ps, n_init=n_init, n_local=n_local, dense_until=0)
    for t, pages in ((n_init + 14 * ps + n_local, 14), (n_init + 16 * ps + n_local + 1, 16)):
        row = policy.prepare(0, slots, t, n, True, (1, 4, 8), torch.float32)
        assert policy.pages[0] == pages
        want = keys.float()[:, n_init:n_init + pages * ps].unflatten(1, (pages, ps))  # [layers, pages, ps, kv, d]
        assert torch.equal(policy.lo[row, :, :pages], want.amin(dim=2))
        assert torch.equal(policy.hi[row, :, :pages], want.amax(dim=2))


def test_quest_original_positions_reach_the_policy():
    """``positions="original"``: the attended keys keep their own positions, and the query its own."""
    torch.manual_seed(1)
    t, n_init, n_local, ps = 120, 4, 8, 16
    cache, slots = cache_with_keys(torch.randn(t, 2, 8))
    policy = Quest(cache, TORCH, k=2 * ps, page_size=ps, n_init=n_init, n_local=n_local, positions="original")
    assert policy.positions == "original"
    plan = step(policy, slots, decode=True, seq_id=0, q=torch.randn(1, 4, 8))
    order = token_order(plan, slots)
    assert len(order) == n_init + 2 * ps + n_local and plan.positions.tolist() == order
    assert plan.q_positions.tolist() == [t]


def test_quest_one_loud_head_is_enough_for_a_page():
    """Heads 0-2 mildly like pages 0 and 1, head 3 strongly likes page 2 only: with one page of budget
    the max over heads keeps head 3's page (a sum over heads would pick page 0)."""
    d, ps = 4, 4
    keys = torch.zeros(12, 4, d)
    keys[0:8, :3, 0] = 1.0  # pages 0 and 1: bound 1 for heads 0-2
    keys[8:12, 3, 1] = 2.0  # page 2: bound 2 for head 3 only
    cache, slots = cache_with_keys(keys)
    q = torch.zeros(1, 4, d)
    q[0, :3, 0] = 1.0
    q[0, 3, 1] = 1.0
    policy = Quest(cache, TORCH, k=ps, page_size=ps, n_init=0, n_local=0)
    plan = step(policy, slots, decode=True, seq_id=0, q=q)
    assert token_order(plan, slots) == [8, 9, 10, 11]


def test_quest_bounds_are_kept_and_extended():
    """Bounds cached from an earlier selection give the same plan as a fresh policy."""
    torch.manual_seed(2)
    keys = torch.randn(400, 2, 8)
    cache, slots = cache_with_keys(keys)
    kept = Quest(cache, TORCH, k=64, page_size=16, n_init=4, n_local=8)
    step(kept, slots[:250], decode=False, seq_id=3, q=torch.randn(4, 4, 8))
    q = torch.randn(1, 4, 8)
    later = step(kept, slots[:399], decode=True, seq_id=3, q=q)
    fresh = Quest(cache, TORCH, k=64, page_size=16, n_init=4, n_local=8)
    assert torch.equal(later.slots, step(fresh, slots[:399], decode=True, seq_id=3, q=q).slots)
    assert kept.pages[3] == (399 - 8 - 4) // 16  # the full pages whose bounds are kept
    kept.release(3)
    assert 3 not in kept.pages and 3 not in kept.rows


# ---- InfLLM ------------------------------------------------------------------------------------------

def local_attention_received(chunks, keys: torch.Tensor, slots: torch.Tensor, n_local: int, t: int) -> torch.Tensor:
    """InfLLM's local score from its definition: for every query i and key j with 0 <= i - j < n_local,
    the key's share of the query's softmax over everything the query attended (the plan's context,
    then the chunk itself up to the query). -> [t, H]."""
    index = {int(s): i for i, s in enumerate(slots)}
    n_heads = chunks[0][1].shape[1]
    group = n_heads // keys.shape[1]
    received = torch.zeros(t, n_heads)
    for t0, q, plan in chunks:
        context = [index[int(s)] for s in plan.slots]
        for r in range(q.shape[0]):
            i = t0 + r
            attended = context + list(range(t0, i + 1))
            for h in range(n_heads):
                logits = keys[attended, h // group] @ q[r, h] / math.sqrt(q.shape[-1])
                p = torch.softmax(logits, dim=0)
                for j, pj in zip(attended, p):
                    if 0 <= i - j < n_local:
                        received[j, h] += pj
    return received


def test_infllm_scores_blocks_with_a_chunks_mean_query_and_a_decode_steps_own():
    """The block scores' query: a selecting prefill chunk's fp32 mean of its queries (as TokenSelect's), a decode
    step's own query; and the scores and the top-k both see only the closed blocks, so that the scores read no
    block whose representatives are not made yet (spied on the real kernels)."""
    torch.manual_seed(6)
    t, bs = 120, 8
    cache, slots = cache_with_keys(torch.randn(t, 2, 8))
    queries, live = [], []

    def block_scores(rows, index, query, n_valid=None):
        queries.append(query.clone())
        live.append(("scores", None if n_valid is None else int(n_valid)))
        return TORCH.block_scores(rows, index, query, n_valid)

    def topk(scores, k, n_valid=None, values=None, out=None):
        live.append(("topk", None if n_valid is None else int(n_valid)))
        return TORCH.topk(scores, k, n_valid, values, out)

    kernels = dataclasses.replace(TORCH, block_scores=block_scores, topk=topk)
    policy = InfLLM(cache, kernels, window=1000, k=2 * bs, n_init=4, n_local=16, block_size=bs, repr_keys=2,
                    dense_until=0)
    for t0 in range(0, t, 5):
        q = torch.randn(5, 4, 8)
        step(policy, slots[:t0], decode=False, seq_id=0, q=q)
    torch.testing.assert_close(queries[-1], q.mean(dim=0).flatten(), rtol=0, atol=1e-6)  # the last chunk's
    q = torch.randn(1, 4, 8)
    step(policy, slots, decode=True, seq_id=0, q=q)
    assert torch.equal(queries[-1], q[0].flatten())
    closed = policy.closed_before(t)  # (120 - 4 - 16) // 8 = 12 of the table's 14 whole blocks
    assert live[-2:] == [("scores", closed), ("topk", closed)] and closed < (t - 4) // bs


def infllm_prompted(t: int, seed: int, **sizes):
    """An InfLLM (dense_until 0, window 1000; k=16, n_init=4, n_local=16, block_size=8, repr_keys=2 unless given)
    after a prompt of t tokens (keys [t, 2, 8]) prefilled 5 at a time -> (cache, slots, policy, the Attended of every
    ``attend`` call, in order)."""
    torch.manual_seed(seed)
    cache, slots = cache_with_keys(torch.randn(t, 2, 8))
    policy = InfLLM(cache, TORCH, window=1000, **(dict(k=16, n_init=4, n_local=16, block_size=8, repr_keys=2,
                                                       dense_until=0) | sizes))
    lists = []
    attend = policy.attend
    policy.attend = lambda *a: lists.append(attend(*a)) or lists[-1]
    for t0 in range(0, t, 5):
        step(policy, slots[:t0], decode=False, seq_id=0, q=torch.randn(5, 4, 8))
    return cache, slots, policy, lists


def test_infllm_decode_counts_its_attention_on_its_window_into_the_ring():
    """A selecting decode step writes into the ring what its query gives each token over the step's list (per head,
    softmax(q . k / sqrt(d))): its own token's entry set to its share (the own entry is the list's first), each
    token of its local window (the n_local - 1 before it; the sinks have no entry) added its share, every other
    entry untouched (the tail's remainder before the window, the chosen blocks, the sinks)."""
    t, d, n_local = 120, 8, 16
    cache, slots, policy, lists = infllm_prompted(t, seed=7)
    cache.write(0, torch.tensor([0]), 3 * torch.randn(1, 2, d), torch.randn(1, 2, d))  # the own token's key (slot 0)
    row = policy._memory[0].row
    before = []  # the ring as the decode step's count finds it (its prepare counts the last chunk's attention first)
    count = policy.count_own_query
    policy.count_own_query = lambda *a: before.append(policy.mass[row, 0].clone()) or count(*a)
    q = torch.randn(1, 4, d)
    step(policy, slots, decode=True, seq_id=0, q=q)
    before = before[0]  # [ring, H]
    seen = lists[-1]
    live = seen.slots[:int(seen.n_valid)]
    assert live[0] == 0  # the own entry first
    logits = torch.einsum("hd,nhd->hn", q[0], cache.k[0][live].repeat_interleave(2, dim=1)) / math.sqrt(d)
    share = logits.softmax(dim=1)  # [H, n]
    token = {int(s): i for i, s in enumerate(slots)} | {0: t}
    expected = before.clone()
    for entry, slot in enumerate(live.tolist()):
        if token[slot] == t:
            expected[t % policy.ring] = share[:, entry]
        elif t - (n_local - 1) <= token[slot] < t:
            expected[token[slot] % policy.ring] += share[:, entry]
    assert policy.ring > t  # no two tokens share an entry here
    torch.testing.assert_close(policy.mass[row, 0], expected, rtol=1e-5, atol=1e-6)


def test_infllm_pool_grows_as_sequences_ask_and_holds_every_block_once():
    """The representatives' pool grows (from its 256-block floor, by 1.25x, or by what a sequence asks when that is
    more) while two sequences of one-token blocks close 688 blocks each, 100 a chunk, and a third asks 3000 at once;
    every block of the grown pool is held or free, once."""
    torch.manual_seed(8)
    t, w = 700, 100
    cache, slots = cache_with_keys(torch.randn(t, 2, 8))
    policy = InfLLM(cache, TORCH, window=10 ** 5, chunk=w, k=4, n_init=4, n_local=8, block_size=1, repr_keys=1,
                    dense_until=0)
    sizes = []
    for seq_id in (0, 1):
        for t0 in range(0, t, w):
            step(policy, slots[:t0], decode=False, seq_id=seq_id, q=torch.randn(w, 4, 8))
            sizes.append(policy.reprs.shape[1])
    held = [policy._memory[s].blocks for s in (0, 1)]
    assert [len(h) for h in held] == [policy.closed_before(t)] * 2 == [688, 688]
    assert sorted(held[0] + held[1] + policy.free) == list(range(sizes[-1]))
    assert sizes[0] == 256 and sizes[-1] >= 2 * 688 and sorted(sizes) == sizes
    third = policy.memory(2, 4, torch.device("cpu"))  # a request larger than 1.25x the pool: it grows by the request
    policy._reserve_blocks(third, 3000)
    assert len(third.blocks) == 3000
    assert sorted(held[0] + held[1] + third.blocks + policy.free) == list(range(policy.reprs.shape[1]))


def test_infllm_keeps_a_decoded_tokens_ring_entry_at_the_next_step():
    """Two decode steps in a row: the first writes its token's entry (its own share), the second adds to it what its
    query gives that token (now in its window) and does not start it again."""
    t, d = 120, 8
    cache, slots, policy, _ = infllm_prompted(t, seed=9)
    cache.write(0, torch.arange(2), torch.randn(2, 2, d), torch.randn(2, 2, d))  # the decoded tokens' keys
    row = policy._memory[0].row
    entries = []
    for own in (0, 1):  # token t at slot 0, then token t + 1 at slot 1
        table = torch.cat([slots, torch.arange(own + 1)])
        seq = start_step(policy, 0, table, t + own, 1, True, (1, 4, d), torch.float32)
        got = policy.attend(0, seq, torch.randn(1, 4, d), torch.tensor([own]))
        entries.append((policy.mass[row, 0, t % policy.ring].clone(), got))
    (first, _), (second, got) = entries
    live = got.slots[:int(got.n_valid)].tolist()
    assert live[0] == 1 and 0 in live  # the second step's own entry first; token t in its window
    assert torch.all(second > first)  # added to, not started again


def test_infllm_sequences_keep_their_memory_while_others_grow_its_rows():
    """Three more sequences start while the first is mid-prompt, growing the per-sequence state twice: the first's
    memory moves with it, and its representatives are those it builds alone."""
    t, d = 120, 8
    torch.manual_seed(10)
    keys = torch.randn(t, 2, d)
    queries = [torch.randn(5, 4, d) for _ in range(0, t, 5)]

    def representatives(others: bool) -> torch.Tensor:
        torch.manual_seed(11)
        cache, slots = cache_with_keys(keys)
        policy = InfLLM(cache, TORCH, window=1000, k=16, n_init=4, n_local=16, block_size=8, repr_keys=2,
                        dense_until=0)
        for i, t0 in enumerate(range(0, t, 5)):
            step(policy, slots[:t0], decode=False, seq_id=0, q=queries[i])
            if others and t0 == 50:
                for seq_id in (1, 2, 3):
                    step(policy, slots[:0], decode=False, seq_id=seq_id, q=queries[0])
        step(policy, slots, decode=True, seq_id=0, q=torch.ones(1, 4, d))
        return policy.representatives(0, 0)

    torch.testing.assert_close(representatives(True), representatives(False), rtol=0, atol=0)


def test_infllm_keeps_its_chunk_buffers_of_at_most_four_shapes():
    """A prompt's chunks of 7 different widths: the buffers of each width are kept for a later prompt, of the last
    four widths only (``SPARE_SHAPES``)."""
    torch.manual_seed(12)
    cache, slots = cache_with_keys(torch.randn(40, 2, 8))
    policy = InfLLM(cache, TORCH, window=1000, k=16, n_init=4, n_local=16, block_size=8, dense_until=0)
    t0 = 0
    for w in range(1, 8):
        step(policy, slots[:t0], decode=False, seq_id=0, q=torch.randn(w, 4, 8))
        t0 += w
    assert [shape[0][0] for shape in policy._spare] == [3, 4, 5, 6]  # given back as the next width came


def test_infllm_fixed_positions_attend_only_the_live_part_of_a_padded_table():
    """Past the window but inside its budget, the fixed scheme attends the whole table at InfLLM's positions. In a
    graph the table is padded past the step's tokens: the list's live count stays length + w, not the table's."""
    torch.manual_seed(2)
    cache, slots = cache_with_keys(torch.randn(40, 2, 8))
    policy = InfLLM(cache, TORCH, window=24, chunk=8, k=16, n_init=4, n_local=8, block_size=4, positions="fixed")
    t = 26  # past the window (24), inside the budget (4 + 16 + 8 = 28)
    own = torch.arange(1)
    seq = start_step(policy, 0, torch.cat([slots[:t], own]), t, 1, True, (1, 4, 8), torch.float32)
    assert seq.mode == FIXED
    padded = SeqStep(torch.cat([seq.table, slots[t:]]), seq.length, seq.row, True, seq.mode, seq.buffers)
    got = policy.attend(0, padded, torch.randn(1, 4, 8), own)
    assert got.slots.numel() == 40 + 1 and int(got.n_valid) == t + 1
    assert got.key_pos[:t + 1].tolist() == [0] * (t - 8) + list(range(8)) + [8]


@pytest.mark.parametrize("t", [120, 115])  # the remainder before the window: 100 % 8 = 4 tokens, 95 % 8 = 7 (its most)
def test_infllm_selecting_lists_are_list_length_long(t):
    """A selecting step's list holds exactly ``list_length(w)`` entries, a chunk's and a decode step's, the live ones
    marked by n_valid: the graphs are captured at that shape (``prepare`` sizes their buffers by it). With the
    longest remainder (block_size - 1 tokens) a decode step's list is all live."""
    n_init, n_local, bs = 4, 16, 8
    cache, slots, policy, lists = infllm_prompted(t, seed=5)
    chunk = lists[-1]
    step(policy, slots, decode=True, seq_id=0, q=torch.randn(1, 4, 8))
    assert (chunk.slots.numel(), lists[-1].slots.numel()) == (policy.list_length(5), policy.list_length(1))
    assert int(lists[-1].n_valid) == 1 + n_init + 2 * bs + (t - n_init - n_local) % bs + n_local
    assert (int(lists[-1].n_valid) == policy.list_length(1)) == (t == 115)


@pytest.mark.parametrize("one_buffer", [False, True])  # True: every chunk's q in one buffer, as a step graph's output
@pytest.mark.parametrize("dense_until", [0, 60])  # 60: chunks ending by token 60 attend everything, past the budget
def test_infllm_representatives_and_block_choice(one_buffer, dense_until):
    """The representatives come from the attention each token received from its chunk's queries, which are
    counted one chunk later: the policy must keep them even when the next chunk's q overwrites their buffer, and
    whether the chunk attended everything (inside ``dense_until``) or selected."""
    torch.manual_seed(3)
    t, n_heads, d = 120, 4, 8
    n_init, n_local, bs, r = 4, 16, 8, 2
    keys = torch.randn(t, 2, d)
    cache, slots = cache_with_keys(keys)
    policy = InfLLM(cache, TORCH, window=1000, k=2 * bs, n_init=n_init, n_local=n_local, block_size=bs, repr_keys=r,
                    dense_until=dense_until)
    chunks, buffer = [], torch.empty(5, n_heads, d)
    for t0 in range(0, t, 5):
        q = torch.randn(5, n_heads, d)
        seen = buffer.copy_(q) if one_buffer else q
        chunks.append((t0, q, step(policy, slots[:t0], decode=False, seq_id=0, q=seen)))
    query = torch.randn(1, n_heads, d)
    plan = step(policy, slots, decode=True, seq_id=0, q=query)  # counts the last chunk, closes blocks

    received = local_attention_received(chunks, keys, slots, n_local, t)
    n_blocks = (t - n_local - n_init) // bs
    reprs = torch.zeros(n_blocks, n_heads, d)
    for b in range(n_blocks):
        block = range(n_init + b * bs, n_init + (b + 1) * bs)
        for h in range(n_heads):
            top = sorted(block, key=lambda j: -received[j, h])[:r]
            reprs[b, h] = keys[top, h // 2].mean(dim=0)
    torch.testing.assert_close(policy.representatives(0, 0), reprs, atol=1e-5, rtol=1e-5)

    block_scores = [sum(query[0, h] @ reprs[b, h] for h in range(n_heads)) for b in range(n_blocks)]
    best = sorted(sorted(range(n_blocks), key=lambda b: -block_scores[b])[:2])
    chosen = [n_init + b * bs + i for b in best for i in range(bs)]
    remainder = list(range(n_init + n_blocks * bs, t - n_local))
    assert token_order(plan, slots) == list(range(n_init)) + chosen + remainder + list(range(t - n_local, t))
    # InfLLM's positions: the memory at one position, n_local before the query; the window as it is
    n_memory = n_init + len(chosen) + len(remainder)
    assert plan.positions.tolist() == [0] * n_memory + list(range(n_local))
    assert plan.q_positions.tolist() == [n_local]
    policy.release(0)
    assert policy._memory == {}


def test_infllm_graph_tensors_are_its_memory_itself():
    """What a whole-step graph records and a check run restores: nothing before the first sequence, then the ring of
    local scores (state) and the representatives and block table (read) themselves, at their addresses."""
    cache, slots = cache_with_keys(torch.randn(100, 2, 8))
    policy = InfLLM(cache, TORCH, window=1000, chunk=8, k=16, n_init=4, n_local=16, block_size=8)
    assert policy.graph_state() == () and policy.graph_reads() == ()
    step(policy, slots[:0], decode=False, seq_id=0, q=torch.randn(8, 4, 8))
    state, reads = policy.graph_state(), policy.graph_reads()
    assert len(state) == 1 and state[0] is policy.mass
    assert len(reads) == 2 and reads[0] is policy.reprs and reads[1] is policy.table


def test_an_infllm_snapshot_releases_its_blocks_once():
    """Releasing a snapshot gives its pool blocks' references back; releasing it again gives nothing back twice."""
    torch.manual_seed(0)
    cache, slots = cache_with_keys(torch.randn(100, 2, 8))
    policy = InfLLM(cache, TORCH, window=1000, chunk=8, k=16, n_init=4, n_local=16, block_size=8)
    for t in range(0, 64, 8):  # prefill in chunks of 8: the blocks before the window close
        step(policy, slots[:t], decode=False, seq_id=0, q=torch.randn(8, 4, 8))
    state = policy.snapshot(0, slots, 64)
    assert state.blocks and all(policy.refs[b] == 2 for b in state.blocks)  # the sequence's and the snapshot's
    state.release()
    assert all(policy.refs[b] == 1 for b in state.blocks) and state.ring is None
    state.release()
    assert all(policy.refs[b] == 1 for b in state.blocks)


def test_infllm_refuses_chunks_its_ring_cannot_hold():
    """The local scores of the tokens not yet in a closed block live in a ring sized for the policy's chunk: a
    longer chunk is an error that says so, not scores silently overwritten."""
    cache, slots = cache_with_keys(torch.randn(300, 2, 8))
    policy = InfLLM(cache, TORCH, window=1000, chunk=8, k=16, n_init=4, n_local=16, block_size=8)
    step(policy, slots[:0], decode=False, seq_id=0, q=torch.randn(8, 4, 8))
    step(policy, slots[:8], decode=False, seq_id=0, q=torch.randn(100, 4, 8))  # counted at the next call
    with pytest.raises(RuntimeError, match="ring of 71 tokens cannot hold tokens 4..107"):  # 23 + 16 + 2 * (8 + 8)
        step(policy, slots[:108], decode=False, seq_id=0, q=torch.randn(8, 4, 8))


def test_infllm_whole_context_is_full_attention_inside_the_window_only():
    torch.manual_seed(5)
    cache, slots = cache_with_keys(torch.randn(100, 2, 8))
    policy = InfLLM(cache, TORCH, window=64, k=4096, n_init=4, n_local=16, block_size=8)
    inside = step(policy, slots[:60], decode=False, seq_id=0, q=torch.randn(4, 4, 8))
    assert token_order(inside, slots) == list(range(60)) and inside.positions.tolist() == list(range(60))
    past = step(policy, slots, decode=False, seq_id=0, q=torch.randn(4, 4, 8))
    assert token_order(past, slots) == list(range(100))
    assert past.positions.tolist() == [0] * 84 + list(range(16))
    assert past.q_positions.tolist() == [16, 17, 18, 19]


@pytest.mark.parametrize("k", [16, 64])  # 64: the memory (sinks and blocks) longer than the tail
@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("positions", ["reindex", "original"])
def test_infllm_other_position_schemes(positions, decode, k):
    """A selecting step's list in order (the sinks, the chosen blocks, the tail), re-indexed 0, 1, ... with the
    queries after it, or at the tokens' own positions; a decode step's own entry (the list's first) too."""
    torch.manual_seed(4)
    cache, slots = cache_with_keys(torch.randn(200, 2, 8))
    policy = InfLLM(cache, TORCH, window=1000, k=k, n_init=4, n_local=16, block_size=8, positions=positions)
    w = 1 if decode else 2
    plan = step(policy, slots, decode=decode, seq_id=0, q=torch.randn(w, 4, 8))
    order = token_order(plan, slots)
    n_memory = 4 + k + (200 - 4 - 16) % 8  # the sinks, the chosen blocks, the remainder before the window
    assert order[:4] == [0, 1, 2, 3] and order[n_memory:] == list(range(184, 200)) and order == sorted(order)
    if positions == "reindex":
        assert plan.positions.tolist() == list(range(len(order)))
        assert plan.q_positions.tolist() == list(range(len(order), len(order) + w))
    else:
        assert plan.positions.tolist() == order and plan.q_positions.tolist() == list(range(200, 200 + w))


# ---- RoPE scaling overrides ----------------------------------------------------------------------------

def hf_config(rope_type: str, factor: float) -> LlamaConfig:
    params = {"rope_type": rope_type, "factor": factor, "rope_theta": 10000.0}
    if rope_type == "yarn":
        params["original_max_position_embeddings"] = 256
    return LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=256, rope_parameters=params)


def test_ntk_override_stretches_the_base(tiny_llama):
    spec = LLM(tiny_llama, rope_scaling="ntk:4").rope.spec
    d = 16
    expected = 1.0 / (10000.0 * 4 ** (d / (d - 2))) ** (torch.arange(0, d, 2).float() / d)
    inv_freq, scale = spec.inv_freq()
    torch.testing.assert_close(inv_freq, expected)
    assert scale == 1.0


def test_dynamic_and_yarn_overrides_match_transformers(tiny_llama):
    dynamic = LLM(tiny_llama, rope_scaling="dynamic:4").rope.spec
    for length in (100, 256, 257, 1024):
        expected, _ = _compute_dynamic_ntk_parameters(hf_config("dynamic", 4.0), seq_len=length)
        torch.testing.assert_close(dynamic.inv_freq(length)[0], expected)
    yarn = LLM(tiny_llama, rope_scaling="yarn:4").rope.spec
    expected, attention_factor = _compute_yarn_parameters(hf_config("yarn", 4.0))
    inv_freq, scale = yarn.inv_freq()
    torch.testing.assert_close(inv_freq, expected)
    assert scale == pytest.approx(attention_factor)


def test_dynamic_ntk_changes_logits_only_past_the_window(tiny_llama):
    ids = torch.randint(2, 300, (320,), generator=torch.Generator().manual_seed(6)).tolist()
    plain = LLM(tiny_llama, chunk_size=32).prompt_logits(ids)
    dynamic = LLM(tiny_llama, chunk_size=32, rope_scaling="dynamic:4").prompt_logits(ids)
    torch.testing.assert_close(dynamic[:256], plain[:256], atol=1e-5, rtol=1e-5)
    assert (dynamic[256:] - plain[256:]).abs().amax(dim=-1).min() > 1e-3


# ---- settings and end to end ----------------------------------------------------------------------------

def test_flags_reach_only_the_policy_that_takes_them():
    parser = argparse.ArgumentParser()
    add_policy_args(parser)
    args = parser.parse_args(["--block-size", "64", "--repr-keys", "2", "--page-size", "8", "--positions", "fixed"])
    infllm, quest = policy_kwargs(args, "infllm"), policy_kwargs(args, "quest")
    assert (infllm["block_size"], infllm["repr_keys"], infllm["positions"]) == (64, 2, "fixed")
    assert "page_size" not in infllm and quest["page_size"] == 8
    assert "block_size" not in quest and "repr_keys" not in quest


@pytest.mark.parametrize("attention", ["streaming", "infllm", "quest"])
def test_prompts_four_times_the_window_generate(tiny_llama, attention):
    """Defaults fitted to the window: every plan stays inside it; two sequences in one batch keep
    their own state (same tokens as run alone); everything is released at the end."""
    llm = LLM(tiny_llama, attention, chunk_size=64)
    seen = []
    attend = llm.policy.attend
    llm.policy.attend = lambda *a: seen.append(attend(*a)) or seen[-1]
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(2, 300, (n,), generator=gen).tolist() for n in (1024, 700)]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    together = llm.generate(prompts, params)
    assert all(len(out.token_ids) == 5 and out.finish_reason == "length" for out in together)
    alone = [llm.generate([p], params)[0].token_ids for p in prompts]
    assert [out.token_ids for out in together] == alone
    live = [a.key_pos[:a.slots.numel() if a.n_valid is None else int(a.n_valid)] for a in seen]
    assert max(int(torch.cat([pos, a.q_pos]).max()) for pos, a in zip(live, seen)) < llm.window
    assert llm.scheduler.available == llm.cache.n_slots
    assert not getattr(llm.policy, "_memory", None) and not getattr(llm.policy, "pages", None)
    assert len(getattr(llm.policy, "rows", ())) == 0

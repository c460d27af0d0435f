"""TokenSelect's two-stage selection (``candidates``): pages ranked by QUEST's bound, then the soft vote among
their tokens. Checked against a plain reference written here from the definition, against one-stage TokenSelect
where the shortlist holds the whole middle, on the Selection Cache's hits, and at its boundaries."""

from __future__ import annotations

import pytest
import torch

from tokenselect import LLM
from tokenselect.kernels import get_kernels
from tokenselect.policies.tokenselect import TokenSelect

from policy_steps import cache_with_keys, step

TORCH = get_kernels("torch")


def shortlist_expected(query: torch.Tensor, keys: torch.Tensor, middle: range, page_size: int, pages: int,
                       k: int) -> list[int]:
    """The definition, in plain loops over pages and heads: a page's score is the best head's sum over channels
    of max(q * min, q * max) of its keys (the live ones of a partial page); the ``pages`` best pages' tokens are
    voted on by the soft vote (each head's softmax over the shortlist, summed) and the ``k`` best are taken."""
    n_heads, n_kv = query.shape[0], keys.shape[1]
    group = n_heads // n_kv
    tokens = list(middle)
    page_tokens = [tokens[i:i + page_size] for i in range(0, len(tokens), page_size)]
    bound = []
    for page in page_tokens:
        lo, hi = keys[page].amin(dim=0), keys[page].amax(dim=0)  # [n_kv, d]
        bound.append(max(float(torch.maximum(query[h] * lo[h // group], query[h] * hi[h // group]).sum())
                         for h in range(n_heads)))
    best = sorted(sorted(range(len(page_tokens)), key=lambda p: -bound[p])[:pages])
    shortlist = [t for p in best for t in page_tokens[p]]
    vote = torch.zeros(len(shortlist))
    for h in range(n_heads):
        vote += torch.softmax(torch.stack([query[h] @ keys[t, h // group] for t in shortlist]), dim=0)
    return sorted(shortlist[i] for i in torch.topk(vote, k).indices.tolist())


def planted(t: int, n_kv: int, d: int, seed: int, last: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Random keys with a few tokens that one kv head's group aligns with, spread over pages (a query of
    4 * n_kv heads); ``last``: one more, louder (in a partial last page: its page ranks among the best)."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(t, n_kv, d, generator=gen)
    q = torch.randn(4 * n_kv, d, generator=gen)
    for i, token in enumerate((41, 90, 150, 151, 199)):
        keys[token, i % n_kv] += 2.0 * q[4 * (i % n_kv)]
    if last is not None:
        keys[last, 0] += 4.0 * q[0]
    return q, keys


@pytest.mark.parametrize("n_kv,page_size,candidates,t", [(1, 16, 64, 300), (2, 8, 40, 263), (4, 16, 80, 300)])
@pytest.mark.parametrize("decode", [True, False])
def test_two_stage_choice_is_the_definition(n_kv, page_size, candidates, t, decode):
    """Prefill (the chunk's mean query) and decode (theta None: every step selects); the middle ends in a partial
    page (t - sinks - window is not a multiple of the page), which holds a planted token; GQA groups of 4."""
    n_init, n_local, k = 4, 16, 24
    q_one, keys = planted(t, n_kv, 16, seed=t + n_kv, last=t - n_local - 2)
    q = q_one[None] if decode else q_one[None] + 0.1 * torch.randn(3, *q_one.shape, generator=torch.Generator()
                                                                   .manual_seed(1))
    cache, slots = cache_with_keys(keys)
    policy = TokenSelect(cache, TORCH, k=k, n_init=n_init, n_local=n_local, theta=None, dense_until=0,
                         candidates=candidates, page_size=page_size)
    seen = step(policy, slots, q, decode=decode)
    chosen = shortlist_expected(q.mean(dim=0), keys, range(n_init, t - n_local), page_size, candidates // page_size,
                                k)
    assert seen.order(slots) == list(range(n_init)) + chosen + list(range(t - n_local, t))


def test_a_shortlist_of_the_whole_middle_chooses_as_one_stage():
    """Candidates covering every page: the shortlist is the middle in order, so the choice (and the order of
    the list) is one-stage TokenSelect's, at every decode step of a growing cache, with the Selection Cache."""
    t0, n_init, n_local, k = 200, 4, 16, 12
    q, keys = planted(t0 + 20, 2, 16, seed=5)
    cache, slots = cache_with_keys(keys)
    one = TokenSelect(cache, TORCH, k=k, n_init=n_init, n_local=n_local, theta=0.5, dense_until=0)
    two = TokenSelect(cache, TORCH, k=k, n_init=n_init, n_local=n_local, theta=0.5, dense_until=0, candidates=512,
                      page_size=16)
    gen = torch.Generator().manual_seed(2)
    for t in range(t0, t0 + 20):
        query = (q + 0.8 * torch.randn(q.shape, generator=gen))[None]
        assert step(two, slots[:t], query, decode=True).slots.tolist() == \
            step(one, slots[:t], query, decode=True).slots.tolist(), t
    assert two.stats() == one.stats() and two.stats().selection_cache_hits > 0  # both reused, at the same steps


def test_a_selection_cache_hit_returns_the_stored_choice_and_ranks_no_page():
    """A decode step whose query repeats the last one hits: the stored choice comes back, and the page scores
    the shortlist would read are all -inf (no live page: the kernel reads no bound)."""
    t, n_init, n_local = 300, 4, 16
    q, keys = planted(t, 2, 16, seed=3)
    cache, slots = cache_with_keys(keys)
    policy = TokenSelect(cache, TORCH, k=24, n_init=n_init, n_local=n_local, theta=0.9, dense_until=0,
                         candidates=64, page_size=16)
    first = step(policy, slots, q[None], decode=True)
    seen_scores = []
    page_scores = policy.bounds.kernels.page_scores
    policy.bounds.kernels = type(policy.bounds.kernels)(**{**vars(policy.bounds.kernels), "page_scores": lambda *a: (
        seen_scores.append(page_scores(*a)) or seen_scores[-1])})
    again = step(policy, slots, q[None], decode=True)
    assert again.slots.tolist() == first.slots.tolist()
    assert policy.stats().selection_cache_hits == 1
    assert len(seen_scores) == 1 and torch.isneginf(seen_scores[0]).all()


@pytest.mark.parametrize("candidates,ok", [(0, True), (24 + 15, False), (24 + 16, True)])
def test_candidates_hold_k_live_tokens_or_are_refused(candidates, ok):
    """At least k + page_size, so that a shortlist with a partial page still holds k live tokens; 0 is off."""
    cache, _ = cache_with_keys(torch.randn(50, 1, 8))
    make = lambda: TokenSelect(cache, TORCH, k=24, candidates=candidates, page_size=16)  # noqa: E731
    if ok:
        assert (make().bounds is None) == (candidates == 0)
    else:
        with pytest.raises(ValueError, match="at least k \\+ page_size"):
            make()


def test_a_shortlist_reaches_the_engine_and_covering_the_middle_equals_one_stage(tiny_llama):
    """Through the engine (prefill in chunks, then decode): a shortlist that covers the middle gives one-stage
    TokenSelect's logits and tokens; a short one changes what is attended, so the logits differ."""
    ids = torch.randint(2, 300, (400,), generator=torch.Generator().manual_seed(0)).tolist()
    settings = dict(k=48, n_init=4, n_local=32, dense_until=0, chunk_size=32)
    one = LLM(tiny_llama, "tokenselect", **settings).prompt_logits(ids)
    covering = LLM(tiny_llama, "tokenselect", candidates=1024, page_size=16, **settings)
    assert covering.policy.shortlist == 64
    torch.testing.assert_close(covering.prompt_logits(ids), one, atol=1e-5, rtol=1e-5)
    short = LLM(tiny_llama, "tokenselect", candidates=64, page_size=16, **settings).prompt_logits(ids)
    assert (short - one).abs().max() > 1e-3

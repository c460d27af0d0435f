"""The prefix cache: the radix tree itself, then the engine reusing prompt KV across requests (outputs unchanged,
token counts as expected, eviction under pressure that never touches a running sequence)."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tokenselect import LLM, SamplingParams
from tokenselect.kv_cache import KVCache
from tokenselect.prefix_cache import PrefixCache, Reuse, reuse_rule

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
CHUNK = 32
# tokenselect selecting inside the tiny model's window (4 sinks + 64 chosen + 16 local: past 84 tokens), so that a
# chunk's KV depends on the chunk's selection
SELECTING = dict(dense_until=0)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def cached_prefix(ids: list[int], earlier: list[list[int]], grain: int) -> int:
    """What the cache should serve of ``ids`` after the prompts ``earlier`` were computed: their longest common
    prefix, at most all but the last token, cut to a multiple of ``grain``."""
    common = max((next((i for i, (a, b) in enumerate(zip(ids, e)) if a != b), min(len(ids), len(e)))
                  for e in earlier), default=0)
    return min(common, len(ids) - 1) // grain * grain


# ---- the tree ------------------------------------------------------------------------------------

def tree(n_slots: int = 64) -> tuple[KVCache, PrefixCache]:
    cache = KVCache(1, n_slots, 1, 4, torch.float32, torch.device("cpu"))
    return cache, PrefixCache(cache)


def cache_prompt(pc: PrefixCache, cache: KVCache, tokens: list[int]):
    """Insert ``tokens`` as a finished sequence would: its own slots, duplicates freed. -> the end node."""
    slots = cache.allocate(len(tokens))
    node, m = pc.insert(pc.root("ns"), tokens, slots, len(tokens))
    cache.free(slots[:m])
    return node


def test_match_of_nothing_cached_is_the_root_and_an_insert_is_matched_token_exactly():
    cache, pc = tree()
    root = pc.root("ns")
    assert pc.match(root, [5, 6, 7], 2, 1) is root  # an empty tree: length 0
    node = cache_prompt(pc, cache, [1, 2, 3, 4, 5])
    assert pc.cached_tokens == 5 and cache.num_free == 59
    assert pc.match(root, [9, 2, 3], 2, 1) is root  # another first token: length 0
    half = pc.match(root, [1, 2, 3, 9, 9, 9], 5, 1)  # diverges after 3 tokens: the node is split there
    assert half.depth == 3 and pc.slots(half).tolist() == pc.slots(node).tolist()[:3]
    assert pc.match(root, [1, 2, 3, 4, 5, 6], 5, 1) is node  # the whole of it
    # the same prompt again: at most all but its last token (whose logits the request needs)
    assert pc.match(root, [1, 2, 3, 4, 5], 4, 1).depth == 4
    assert pc.match(root, [1, 2, 3, 4, 5, 6], 5, 2).depth == 4  # cut to the grain
    assert pc.match(root, [1, 2, 3, 4, 5, 6], 5, 8) is root
    assert pc.match(pc.root("other"), [1, 2, 3, 4, 5, 6], 5, 1).depth == 0  # namespaces do not share


def test_insert_reports_what_was_cached_already():
    cache, pc = tree()
    cache_prompt(pc, cache, [1, 2, 3, 4])
    slots = cache.allocate(6)
    node, m = pc.insert(pc.root("ns"), [1, 2, 3, 7, 8, 9], slots, 6)
    assert m == 3 and node.depth == 6 and pc.cached_tokens == 7
    assert pc.slots(node).tolist()[3:] == slots.tolist()[3:]  # the new tokens keep the caller's slots


def test_locked_prefixes_survive_eviction_and_the_least_recently_used_leaf_goes_first_from_its_end():
    cache, pc = tree(16)
    a = cache_prompt(pc, cache, [1, 2, 3, 4, 5, 6])
    b = cache_prompt(pc, cache, [1, 2, 3, 7, 8, 9])  # shares [1, 2, 3] with a
    cache_prompt(pc, cache, [20, 21, 22, 23])
    assert pc.cached_tokens == 13 and cache.num_free == 3
    pc.lock(b)  # a running sequence holds [1, 2, 3, 7, 8, 9]
    assert pc.locked_tokens == 6 and pc.evictable_tokens == 7
    pc.lock(a), pc.unlock(a)  # a used after c: c is the least recently used
    assert pc.evict(2) == 2 and pc.match(pc.root("ns"), [20, 21, 22, 23, 0], 4, 1).depth == 2  # c's end went
    assert pc.evict(4) == 4  # the rest of c, then a's end: [4, 5, 6] would be next, 2 of them taken
    assert pc.match(pc.root("ns"), [1, 2, 3, 4, 5, 6, 0], 6, 1).depth == 4
    assert pc.evict(100) == 1  # only a's last unlocked token is left: [1, 2, 3] is b's too
    assert pc.cached_tokens == pc.locked_tokens == 6 and cache.num_free == 16 - 6
    assert pc.match(pc.root("ns"), [1, 2, 3, 7, 8, 9, 0], 6, 1) is b
    pc.unlock(b)
    assert pc.clear() == 6 and cache.num_free == 16 and pc.evicted_tokens == 13


def test_reuse_rules():
    assert reuse_rule("full", {}, "default", 512) == Reuse(("full", "[]"), 1, generated=True)
    assert reuse_rule("full", {}, "dynamic", 512).grain == 512  # dynamic NTK follows each chunk's end
    assert reuse_rule("tokenselect", {"k": 8}, "default", 512).grain == 512
    assert reuse_rule("tokenselect", {"k": 8}, "default", 512) != reuse_rule("tokenselect", {"k": 9}, "default", 512)
    assert reuse_rule("infllm", {}, "default", 512) == Reuse(("infllm", "[]"), 512, stateful=True)
    assert reuse_rule("full", {}, "default", 512).generated and not reuse_rule("full", {}, "dynamic", 512).generated
    assert not any(reuse_rule(p, {}, "default", 512).generated for p in ("tokenselect", "quest", "infllm"))
    # TokenSelect's query groups choose alone: a prefix may end at any group's start, where the group divides the chunk
    assert reuse_rule("tokenselect", {}, "default", 2048).grain == 512
    assert reuse_rule("tokenselect", {"prefill_group": 256}, "default", 2048).grain == 256
    assert reuse_rule("tokenselect", {"prefill_group": 0}, "default", 2048).grain == 2048
    assert reuse_rule("tokenselect", {"prefill_group": 300}, "default", 2048).grain == 2048
    assert reuse_rule("tokenselect", {}, "default", 512).grain == 512  # a group as long as the chunk
    assert reuse_rule("tokenselect", {}, "dynamic", 2048).grain == 2048
    assert reuse_rule("quest", {}, "default", 2048).grain == 2048


class FakeState:
    """A policy snapshot as the tree sees it: its owner, its bytes, whether it was released."""

    def __init__(self, nbytes: int, owner="policy"):
        self.nbytes, self.owner, self.released = nbytes, owner, False

    def release(self):
        assert not self.released
        self.released = True


def test_snapshots_go_with_their_nodes_and_the_least_recently_used_go_past_the_budget():
    cache, pc = tree(64)
    pc.max_state_bytes = 100
    a = cache_prompt(pc, cache, [1, 2, 3, 4, 5, 6, 7, 8])
    mid = pc.match(pc.root("ns"), [1, 2, 3, 4, 0], 4, 1)  # a node ends at 4 now
    states = [FakeState(40), FakeState(40), FakeState(40)]
    pc.set_state(a, states[0]), pc.set_state(mid, states[1])
    assert pc.state_bytes == 80 and pc.stats()["prefix_cache_state_bytes"] == 80
    # a match for a policy ends at the deepest node holding its own snapshot, at the grain, within the limit
    assert pc.match(pc.root("ns"), [1, 2, 3, 4, 5, 6, 7, 8, 9], 8, 1, "policy") is a
    assert pc.match(pc.root("ns"), [1, 2, 3, 4, 5, 6, 7, 8, 9], 7, 1, "policy") is mid
    assert pc.match(pc.root("ns"), [1, 2, 3, 4, 5, 6, 7, 8, 9], 8, 8, "policy") is a
    assert pc.match(pc.root("ns"), [1, 2, 3, 4, 5, 6, 7, 8, 9], 8, 3, "policy") is pc.root("ns")
    assert pc.match(pc.root("ns"), [1, 2, 3, 4, 5, 6, 7, 8, 9], 8, 1, "another") is pc.root("ns")
    pc.lock(mid), pc.unlock(mid)  # mid used last: a's snapshot is the least recently used
    b = cache_prompt(pc, cache, [1, 2, 3, 4, 9, 9, 9, 9])
    pc.set_state(b, states[2])  # 120 bytes > 100: a's goes
    assert states[0].released and a.state is None and pc.state_bytes == 80 and not states[1].released
    pc.set_state(b, FakeState(200))  # more than the budget alone: not kept (b's old one is replaced: released)
    assert states[2].released and b.state is None and pc.state_bytes == 40
    last = FakeState(30)
    pc.set_state(a, last)
    assert pc.evict(1) == 1 and last.released and a.state is None  # a, least recently used, lost its end: its snapshot
    assert pc.state_bytes == 40 and mid.state is states[1]
    pc.drop_states("another")
    assert mid.state is states[1]
    pc.drop_states("policy")  # the engine dropped the policy instance: its snapshots go
    assert states[1].released and pc.state_bytes == 0
    pc.set_state(mid, FakeState(10))
    pc.clear()
    assert pc.state_bytes == 0 and mid.state is None


# ---- the engine ----------------------------------------------------------------------------------

def engine(path, attention: str, reuse: bool = True, **settings) -> LLM:
    extra = SELECTING if attention == "tokenselect" else INFLLM if attention == "infllm" else {}
    return LLM(path, attention, chunk_size=CHUNK, prefix_cache=reuse, **{**extra, **settings})


DOC = prompt(200, 1)
QUESTIONS = [DOC + prompt(5 + 3 * i, 10 + i) for i in range(4)]
# InfLLM selecting inside the tiny model's window: past n_init + 39 + 16 tokens, blocks of 8 tokens
INFLLM = dict(n_local=16, k=32, block_size=8, dense_until=0)


@pytest.mark.parametrize("attention", ["full", "tokenselect", "infllm"])
def test_questions_in_turn_reuse_the_document_and_answer_as_without(tiny_llama, attention):
    grain = 1 if attention == "full" else CHUNK
    without = engine(tiny_llama, attention, reuse=False)
    expected = [without.generate(q, GREEDY)[0].token_ids for q in QUESTIONS]
    llm = engine(tiny_llama, attention)
    outs = [llm.generate(q, GREEDY)[0] for q in QUESTIONS]
    assert [o.token_ids for o in outs] == expected
    want = [cached_prefix(q, QUESTIONS[:i], grain) for i, q in enumerate(QUESTIONS)]
    assert want == [0] + [200 // grain * grain] * 3  # the document, to the grain
    assert [o.cached_tokens for o in outs] == want
    stats = llm.stats()
    assert stats["prefix_cache_hit_tokens"] == sum(want) and stats["prefix_cache_evicted_tokens"] == 0
    assert llm.scheduler.available == llm.cache.n_slots  # nothing held once they are done
    assert without.stats().get("prefix_cache_hit_tokens") is None and without.cache.num_free == without.cache.n_slots


@pytest.mark.parametrize("attention", ["full", "tokenselect", "infllm"])
def test_questions_at_once_reuse_what_the_first_computed(tiny_llama, batch_invariant_matmuls, attention):
    """Queued together: the first prefills the document, the others (still waiting for the step's chunk budget)
    find it cached before their first chunk, and the batched answers equal the ones computed alone."""
    expected = [engine(tiny_llama, attention, reuse=False).generate(q, GREEDY)[0].token_ids for q in QUESTIONS]
    llm = engine(tiny_llama, attention)
    outs = llm.generate(QUESTIONS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    assert outs[0].cached_tokens == 0
    # the first's chunks are cached as they complete, to the grain: the chunk boundary 192 for tokenselect. With
    # full attention (grain 1) the second's first chunk (192..208) fits beside the first's last (192..205, 13 of
    # the step's 32 tokens) and computes the document's end itself; the later ones find the first's whole prompt
    assert [o.cached_tokens for o in outs[1:]] == ([192, 200, 200] if attention == "full" else [192] * 3)


@pytest.mark.parametrize("attention", ["full", "tokenselect"])
def test_prompt_asked_again_computes_its_last_token(tiny_llama, attention):
    """Prefix == the whole prompt: the last token is computed again, for the logits of the first new token."""
    llm = engine(tiny_llama, attention)
    ids = prompt(CHUNK * 4, 3)  # a multiple of the chunk
    first, again = llm.generate(ids, GREEDY)[0], llm.generate(ids, GREEDY)[0]
    assert again.token_ids == first.token_ids
    assert first.cached_tokens == 0
    assert again.cached_tokens == (len(ids) - 1 if attention == "full" else len(ids) - CHUNK)
    one = llm.generate(ids[:1], GREEDY)[0]  # a one-token prompt can reuse nothing
    assert one.cached_tokens == 0


@pytest.mark.parametrize("attention", ["quest", "reattention", "streaming", "infllm"])
def test_every_policy_answers_as_without_reuse(tiny_llama, attention):
    """Quest's page bounds are rebuilt from the reused keys, ReAttention and StreamingLLM keep no state;
    InfLLM's memory (built from the prompt's queries) comes from the snapshot kept with the prefix."""
    settings = dict(n_local=16, k=32) if attention in ("quest", "infllm") else dict(n_local=16)
    if attention == "infllm":
        settings["block_size"] = 8
    expected = [engine(tiny_llama, attention, reuse=False, **settings).generate(q, GREEDY)[0].token_ids
                for q in QUESTIONS[:2]]
    llm = engine(tiny_llama, attention, **settings)
    outs = [llm.generate(q, GREEDY)[0] for q in QUESTIONS[:2]]
    assert [o.token_ids for o in outs] == expected
    assert outs[1].cached_tokens == 192


@pytest.mark.parametrize("attention, kv", [
    ("tokenselect", dict(kv_dtype="fp8")), ("tokenselect", dict(kv_offload="values")),
    ("tokenselect", dict(select_dtype="fp8")), ("infllm", dict(kv_dtype="fp8")),
    ("infllm", dict(kv_offload="values", cuda_graphs=True))])
def test_reuse_with_fp8_and_offloaded_values(tiny_llama, attention, kv):
    """(cuda_graphs on a CPU: the graphs' step functions, run eagerly)"""
    kv = {**kv, **(INFLLM if attention == "infllm" else {})}
    expected = [engine(tiny_llama, attention, reuse=False, **kv).generate(q, GREEDY)[0].token_ids
                for q in QUESTIONS[:2]]
    llm = engine(tiny_llama, attention, **kv)
    outs = [llm.generate(q, GREEDY)[0] for q in QUESTIONS[:2]]
    assert [o.token_ids for o in outs] == expected and outs[1].cached_tokens == 192


def test_requests_with_other_policy_settings_do_not_share(tiny_llama):
    """KV past layer 0 depends on what the layers below attended: another k computes its own."""
    llm = engine(tiny_llama, "tokenselect")
    own = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    a = llm.add_request(QUESTIONS[0], own, {"k": 16})
    while llm.scheduler.has_work():
        llm.step()
    b = llm.add_request(QUESTIONS[1], own)
    c = llm.add_request(QUESTIONS[2], own, {"k": 16})
    while llm.scheduler.has_work():
        llm.step()
    assert (a.cached_tokens, b.cached_tokens, c.cached_tokens) == (0, 0, 192)


def test_another_policy_on_the_same_engine_computes_its_own(tiny_llama):
    llm = engine(tiny_llama, "full")
    llm.generate(QUESTIONS[0], GREEDY)
    llm.set_attention("tokenselect", **SELECTING)
    assert llm.generate(QUESTIONS[1], GREEDY)[0].cached_tokens == 0
    llm.set_attention("full")
    assert llm.generate(QUESTIONS[1], GREEDY)[0].cached_tokens == 200  # what full attention cached is still there


def test_a_request_is_never_refused_for_room_that_eviction_frees(tiny_llama):
    """A pool full of cached prompts (and, with full attention, their answers): a request needing almost all of it
    evicts them and runs."""
    llm = engine(tiny_llama, "full", kv_cache_tokens=256)
    for seed in range(3):
        llm.generate(prompt(70, seed), GREEDY)
    held = 3 * (70 + GREEDY.max_tokens - 1)  # prompts and answers, but each answer's last token (never fed back)
    assert llm.stats()["prefix_cache_tokens"] == held == 231 and llm.cache.num_free == 256 - held
    big = prompt(256 - GREEDY.max_tokens, 9)  # exactly the pool's capacity with its max_tokens
    out = llm.generate(big, GREEDY)[0]
    assert len(out.token_ids) == GREEDY.max_tokens
    # it took 255 slots (its last new token is never fed back): 230 cached tokens went, one stays, and its own
    # prompt and answer are cached now
    assert out.cached_tokens == 0
    assert llm.stats()["prefix_cache_evicted_tokens"] == held - 1
    assert llm.stats()["prefix_cache_tokens"] == 1 + len(big) + GREEDY.max_tokens - 1
    assert out.token_ids == engine(tiny_llama, "full", reuse=False, kv_cache_tokens=256).generate(
        big, GREEDY)[0].token_ids


def test_eviction_under_pressure_never_touches_a_running_sequence(tiny_llama, batch_invariant_matmuls):
    """A small pool, many overlapping prompts arriving over time: every eviction frees slots that no running
    sequence holds, the answers equal an engine's without reuse, and nothing is held at the end."""
    rng = random.Random(0)
    stems = [prompt(96, 100 + i) for i in range(3)]
    prompts = [rng.choice(stems)[:rng.randrange(40, 97)] + prompt(rng.randrange(1, 20), 200 + i) for i in range(24)]
    llm = engine(tiny_llama, "tokenselect", kv_cache_tokens=400, max_num_seqs=4)
    prefix = llm.scheduler.prefix
    evict = prefix.evict

    def checked_evict(n: int) -> int:
        before = set(range(llm.cache.n_slots)) - set(llm.cache._stack[:llm.cache.num_free].tolist())
        freed = evict(n)
        now_free = set(llm.cache._stack[:llm.cache.num_free].tolist()) & before
        for seq in llm.scheduler.running:
            held = set(seq.slots[:seq.n_cached].tolist())
            assert not held & now_free, f"eviction freed slots of running sequence {seq.id}"
        return freed

    prefix.evict = checked_evict
    seqs = []
    for i, p in enumerate(prompts):  # three new requests a step, the engine stepping in between
        seqs.append(llm.add_request(p, GREEDY))
        if i % 3 == 2:
            llm.step()
    while llm.scheduler.has_work():
        llm.step()
    reference = engine(tiny_llama, "tokenselect", reuse=False)
    assert [s.output_ids for s in seqs] == [reference.generate(p, GREEDY)[0].token_ids for p in prompts]
    stats = llm.stats()
    assert stats["prefix_cache_evicted_tokens"] > 0 and stats["prefix_cache_hit_tokens"] > 0  # both happened
    assert all(s.finish_reason == "length" for s in seqs)
    assert llm.scheduler.available == llm.cache.n_slots and prefix.locked_tokens == 0


def test_prompt_logits_compute_every_row_whatever_is_cached(tiny_llama):
    llm = engine(tiny_llama, "full")
    llm.generate(QUESTIONS[0], GREEDY)
    logits = llm.prompt_logits(QUESTIONS[1])
    assert logits.shape[0] == len(QUESTIONS[1])
    torch.testing.assert_close(logits, engine(tiny_llama, "full", reuse=False).prompt_logits(QUESTIONS[1]))


def test_one_token_requests_release_what_they_hold(tiny_llama):
    """A request that ends at its first token (finished inside the step that computed its last chunk) leaves no
    cached token locked."""
    llm = engine(tiny_llama, "tokenselect")
    one = SamplingParams(max_tokens=1, temperature=0)
    outs = llm.generate(QUESTIONS, one) + [llm.generate(q, one)[0] for q in QUESTIONS]
    assert [o.cached_tokens for o in outs[4:]] == [192] * 4
    assert llm.scheduler.prefix.locked_tokens == 0 and llm.scheduler.available == llm.cache.n_slots


def test_aborted_prefill_keeps_its_computed_chunks(tiny_llama):
    llm = engine(tiny_llama, "tokenselect")
    seq = llm.add_request(QUESTIONS[0], GREEDY)
    for _ in range(3):
        llm.step()
    llm.abort(seq)
    assert llm.stats()["prefix_cache_tokens"] == 3 * CHUNK and llm.scheduler.available == llm.cache.n_slots
    assert llm.generate(QUESTIONS[1], GREEDY)[0].cached_tokens == 3 * CHUNK


def test_set_prefix_cache_turns_reuse_off_and_frees_the_cache(tiny_llama):
    llm = engine(tiny_llama, "full")
    llm.generate(QUESTIONS[0], GREEDY)
    llm.set_prefix_cache(False)
    assert llm.cache.num_free == llm.cache.n_slots and "prefix_cache_tokens" not in llm.stats()
    assert llm.generate(QUESTIONS[1], GREEDY)[0].cached_tokens == 0
    llm.set_prefix_cache(True)
    llm.generate(QUESTIONS[0], GREEDY)
    assert llm.generate(QUESTIONS[1], GREEDY)[0].cached_tokens == 200


def test_many_questions_over_one_document_with_the_embedded_model():
    """The shipped model, text prompts: a document and ten questions in turn, then ten at once. Each follow-up
    reuses the document up to the last chunk boundary its tokens share with an earlier prompt."""
    llm = LLM(None, "tokenselect", chunk_size=64, kv_cache_tokens=4096)
    doc = "The contract between the two parties was signed in spring. " * 30
    ask = [f"\nQuestion {i}: what happened in clause {i}?\nAnswer:" for i in range(10)]
    ids = [llm.encode(doc + q) for q in ask]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    turns = [llm.generate(doc + q, params)[0] for q in ask]
    want = [cached_prefix(x, ids[:i], 64) for i, x in enumerate(ids)]
    assert want[0] == 0 and min(want[1:]) >= len(llm.encode(doc)) // 64 * 64 - 64 > 0
    assert [o.cached_tokens for o in turns] == want
    at_once = llm.generate([doc + q for q in ask], params)
    assert [o.token_ids for o in at_once] == [o.token_ids for o in turns]
    assert [o.cached_tokens for o in at_once] == [cached_prefix(x, ids, 64) for x in ids]  # all cached now
    assert llm.stats()["prefix_cache_hit_tokens"] == sum(want) + sum(o.cached_tokens for o in at_once)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("attention", ["full", "tokenselect", "infllm"])
def test_reuse_in_cuda_graphs_answers_as_without(tiny_llama, attention):
    """Steps as CUDA graphs (decode and full prefill chunks whole, the rest per layer) over a reused prefix."""
    long_doc = prompt(CHUNK * 20, 5)  # a long prompt (16 chunks or more): its full chunks run as whole-step graphs
    questions = [long_doc + prompt(9, 50 + i) for i in range(3)]
    kw = dict(cuda_graphs=True, dtype="float32")
    expected = [engine(tiny_llama, attention, reuse=False, **kw).generate(q, GREEDY)[0].token_ids for q in questions]
    llm = engine(tiny_llama, attention, **kw)
    turns = [llm.generate(q, GREEDY)[0] for q in questions]
    assert [o.token_ids for o in turns] == expected and turns[2].cached_tokens >= len(long_doc) - CHUNK
    assert llm.runner.graphs.whole_steps > 0 and llm.runner.graphs.failure is None
    assert [o.token_ids for o in llm.generate(questions, GREEDY)] == expected


@pytest.mark.parametrize("attention", ["tokenselect", "quest"])
def test_a_prompt_that_leaves_a_cached_one_inside_a_chunk_keeps_its_own_kv_there(tiny_llama, attention):
    """Both prompts compute the chunk 192..224 and part at 200: past layer 0 the KV of 192..199 depends on the rest
    of the chunk, so the second keeps its own (the cache keeps the first's chunk) and answers as without reuse."""
    first, second = DOC + prompt(60, 30), DOC + prompt(26, 37)
    llm = engine(tiny_llama, attention)
    llm.generate(first, GREEDY)
    out = llm.generate(second, GREEDY)[0]
    assert out.cached_tokens == 192
    assert out.token_ids == engine(tiny_llama, attention, reuse=False).generate(second, GREEDY)[0].token_ids
    assert llm.stats()["prefix_cache_tokens"] == len(first) // CHUNK * CHUNK  # nothing of the second's past 192


def test_tail_chunks_are_not_reused(tiny_llama):
    """With ``tail_chunk`` a prompt's last tokens run as a chunk of their own, and the chunk before them stops short:
    neither is what a longer prompt computes there, so neither is cached, and no match reaches into a tail."""
    first, second = QUESTIONS[0], DOC + prompt(60, 30)  # 205 tokens: chunks ..., 160..189, the tail 189..205
    llm = engine(tiny_llama, "tokenselect", tail_chunk=16)
    assert llm.generate(first, GREEDY)[0].cached_tokens == 0 and llm.stats()["prefix_cache_tokens"] == 160
    out = llm.generate(second, GREEDY)[0]
    assert out.cached_tokens == 160
    assert out.token_ids == engine(tiny_llama, "tokenselect", reuse=False, tail_chunk=16).generate(
        second, GREEDY)[0].token_ids
    again = llm.generate(first, GREEDY)[0]  # all of it cached up to 224 now, but its match stops before its tail
    assert again.cached_tokens == 160 and again.token_ids == llm.generate(first, GREEDY)[0].token_ids


# ---- InfLLM: its memory goes with the prefix --------------------------------------------------------

# ten questions over DOC; the first runs past two more chunk boundaries (224, 256), the last three past 224
TEN = [DOC + prompt(60, 30)] + [DOC + prompt(5 + 3 * i, 30 + i) for i in range(1, 10)]


def test_infllm_ten_questions_in_turn_and_at_once_answer_as_without_reuse(tiny_llama, batch_invariant_matmuls):
    """The first question snapshots InfLLM's memory at the last two chunk boundaries of its prompt (224, 256). The
    second wants the document's last boundary (192), finds no snapshot there, computes its prompt and leaves one;
    the eight others start there. Then all ten at once: the first finds its whole prompt cached, the others the
    document (the last three computed the chunk 192..224 too, but the cache holds the first's there)."""
    expected = [engine(tiny_llama, "infllm", reuse=False).generate(q, GREEDY)[0].token_ids for q in TEN]
    llm = engine(tiny_llama, "infllm")
    turns = [llm.generate(q, GREEDY)[0] for q in TEN]
    assert [o.token_ids for o in turns] == expected
    assert [o.cached_tokens for o in turns] == [0, 0] + [192] * 8
    at_once = llm.generate(TEN, GREEDY)
    assert [o.token_ids for o in at_once] == expected
    assert [o.cached_tokens for o in at_once] == [256] + [192] * 9
    prefix, policy = llm.scheduler.prefix, llm.policy
    assert prefix.locked_tokens == 0 and not policy._memory and 0 < prefix.state_bytes <= prefix.max_state_bytes
    prefix.clear()  # the snapshots held the only references to their pool blocks: all of them are free again
    assert prefix.state_bytes == 0 and not policy.refs and sorted(policy.free) == list(range(policy.reprs.shape[1]))


@pytest.mark.parametrize("n_local, first, second, at, pieces", [
    (16, QUESTIONS[0], QUESTIONS[1], 192, 1),
    # a ring of (32 + 28) + 2 * (32 + 8) = 140 entries: at 160 the live tokens 132..159 wrap around its end
    (28, DOC[:170] + prompt(4, 10), DOC[:170] + prompt(6, 11), 160, 2)])
def test_infllm_restored_memory_is_the_memory_a_prefill_builds(tiny_llama, n_local, first, second, at, pieces):
    """A sequence starting after the cached document (``at`` tokens) has, before its first step, the memory a
    sequence that computed the document has there: the same closed blocks and representatives, the same local
    scores, also where the live tokens' ring entries wrap around the ring's end (two pieces)."""
    settings = dict(n_local=n_local)
    llm = engine(tiny_llama, "infllm", **settings)
    llm.generate(first, GREEDY)
    seq = llm.add_request(second, GREEDY)
    with torch.inference_mode():
        llm.scheduler.schedule()  # admitted: it starts after ``at`` tokens, from the snapshot there
    assert seq.n_cached == at
    ref = engine(tiny_llama, "infllm", reuse=False, **settings)
    own = ref.add_request(second, GREEDY)
    while own.n_cached < at:
        ref.step()
    cfg, n = llm.config, len(second)
    shape = (n - at, cfg.n_heads, cfg.head_dim)
    for engine_, s in ((llm, seq), (ref, own)):  # what the first step of the rest sees (the last chunk counted)
        s.slots[at:n] = engine_.scheduler.allocate(n - at)
        with torch.inference_mode():
            engine_.policy.prepare(s.id, s.slots, at, n, False, shape, torch.float32)
    a, b = llm.policy._memory[seq.id], ref.policy._memory[own.id]
    assert len(a.layers) == cfg.n_layers
    for layer, (mine, theirs) in enumerate(zip(a.layers, b.layers)):
        assert (mine.closed, mine.tracked) == (theirs.closed, theirs.tracked) and mine.closed == (at - 4 - n_local) // 8
        torch.testing.assert_close(llm.policy.representatives(seq.id, layer),
                                   ref.policy.representatives(own.id, layer), rtol=0, atol=0)
        live = [entries for entries, _ in llm.policy.ring_spans(llm.policy.tracked_from(mine), at)]
        assert len(live) == pieces and sum(e.stop - e.start for e in live) == at - 4 - mine.closed * 8 > 0
        for entries in live:
            assert mine.ring[entries].abs().sum() > 0
            torch.testing.assert_close(mine.ring[entries], theirs.ring[entries], rtol=0, atol=0)


def snapshots_of(policy) -> list:
    """The snapshots ``policy`` takes from now on, in order (its own ``snapshot`` still takes them)."""
    taken, take = [], policy.snapshot
    policy.snapshot = lambda *args: taken.append(take(*args)) or taken[-1]
    return taken


def test_infllm_snapshot_among_its_sinks_holds_no_local_scores_and_restores(tiny_llama):
    """A prompt's chunk boundary at 32 tokens, inside InfLLM's 48 sinks: the snapshot there has no ring entries (its
    local scores start after the sinks), and a question that starts from it answers as without reuse."""
    settings = dict(n_init=48)
    first, second = DOC[:36] + prompt(4, 10), DOC[:36] + prompt(6, 11)
    llm = engine(tiny_llama, "infllm", **settings)
    taken = snapshots_of(llm.policy)
    llm.generate(first, GREEDY)
    snapshot = next(state for state in taken if state.t == 32)
    assert snapshot.ring.shape == (llm.config.n_layers, 0, llm.config.n_heads) and snapshot.closed == 0
    out = llm.generate(second, GREEDY)[0]
    assert out.cached_tokens == 32
    assert out.token_ids == engine(tiny_llama, "infllm", reuse=False, **settings).generate(second, GREEDY)[0].token_ids


def test_infllm_restores_only_its_own_snapshots(tiny_llama):
    llm = engine(tiny_llama, "infllm")
    taken = snapshots_of(llm.policy)
    llm.generate(QUESTIONS[0], GREEDY)
    theirs = taken[-1]
    other = engine(tiny_llama, "infllm").policy
    with pytest.raises(AssertionError, match="^a prefix snapshot of another InfLLM instance$"):
        other.restore(0, theirs)


def test_infllm_eviction_drops_the_snapshot_and_a_match_falls_back_to_the_one_before(tiny_llama):
    llm = engine(tiny_llama, "infllm")
    llm.generate(QUESTIONS[0], GREEDY)  # snapshots at 160 and 192, the last two chunk boundaries of its prompt
    prefix, policy = llm.scheduler.prefix, llm.policy
    both = prefix.state_bytes
    assert both > 0 and policy.refs  # pool blocks held by the snapshots alone
    assert prefix.evict(1) == 1  # the document's last cached token: the snapshot at 192 goes with it
    assert 0 < prefix.state_bytes < both
    out = llm.generate(QUESTIONS[1], GREEDY)[0]
    assert out.cached_tokens == 160
    assert out.token_ids == engine(tiny_llama, "infllm", reuse=False).generate(QUESTIONS[1], GREEDY)[0].token_ids
    prefix.clear()
    assert prefix.state_bytes == 0 and not policy.refs and sorted(policy.free) == list(range(policy.reprs.shape[1]))
    # another policy instance does not read this one's snapshots: they go with it
    llm.generate(QUESTIONS[0], GREEDY)
    assert prefix.state_bytes > 0
    llm.set_attention("infllm", **INFLLM)
    assert prefix.state_bytes == 0 and llm.generate(QUESTIONS[1], GREEDY)[0].cached_tokens == 0


# ---- generated tokens --------------------------------------------------------------------------------------

def test_a_chats_next_turn_reuses_the_previous_answer_where_decode_computes_what_prefill_does(
        tiny_llama, batch_invariant_matmuls):
    """Full attention caches a finished sequence's prompt and answer (but its last token, whose KV was never
    computed): the next turn (prompt + answer + a new message) computes only its new message, with the same output.
    A selecting policy's decode step attends its own per-token choice, so the answer's KV past layer 0 is not what a
    prefill chunk of the same tokens computes: it caches the prompt only."""
    turn1 = QUESTIONS[0]
    for attention in ("full", "tokenselect"):
        llm = engine(tiny_llama, attention)
        answer = llm.generate(turn1, GREEDY)[0].token_ids
        turn2 = turn1 + answer + prompt(7, 99)
        out = llm.generate(turn2, GREEDY)[0]
        assert out.token_ids == engine(tiny_llama, attention, reuse=False).generate(turn2, GREEDY)[0].token_ids
        assert out.cached_tokens == (len(turn1) + len(answer) - 1 if attention == "full" else 192)
        # the answer's keys in layer 1, computed by decode steps, and by the prefill of the next turn
        ref = engine(tiny_llama, attention, reuse=False)
        seqs, keys = [], []
        for ids in (turn1, turn2):
            seqs.append(ref.add_request(ids, GREEDY))
            while not seqs[-1].finished:
                ref.step()
            keys.append(ref.cache.k[1][seqs[-1].slots[len(turn1):len(turn1) + len(answer) - 1]].clone())
        assert seqs[0].output_ids == answer
        assert torch.allclose(keys[0], keys[1], atol=1e-5) == (attention == "full")


def test_benchmark_script_runs_at_a_tiny_size(tmp_path):
    """``benchmarks/prefix_reuse.py`` (the GPU benchmark) end to end on the CPU: its runs, its token counts."""
    from benchmark_scripts import load

    bench = load("prefix_reuse")
    assert bench.main([str(tmp_path), "--config", "tiny", "--layers", "1", "--doc-tokens", "700", "--questions", "3",
                       "--question-tokens", "16", "--max-tokens", "2", "--chunk-size", "64",
                       "--kv-cache-tokens", "4096", "--device", "cpu"]) == 0
    result = json.loads((tmp_path / "prefix_reuse.json").read_text())
    cached = {label: [r["cached_tokens"] for r in rows] for label, rows in result["runs"].items()}
    assert cached == {"without reuse, in turn": [0, 0, 0], "without reuse, at once": [0, 0, 0],
                      "with reuse, in turn": [0, 640, 640], "with reuse, at once": [0, 640, 640]}
    assert all(r["ttft_s"] > 0 for rows in result["runs"].values() for r in rows)
    text = (tmp_path / "prefix_reuse.md").read_text()
    assert "| 2 |" in text and "follow-up question (2..3, in turn) with reuse: median" in text

"""Steps captured whole (``cuda_graphs.GraphCache.run_whole``): decode steps and a long prompt's full prefill chunks. A policy
chooses on the device from a slot table of fixed size (the sequence's tokens, then padding), and in decode
the Selection Cache's decision gates the selection work. On a CPU the step function runs eagerly; on a GPU
the same tests record and replay CUDA graphs. Either way it must choose what the exact table gives and
generate the plain path's tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tokenselect import LLM, SamplingParams
from tokenselect import cuda_graphs
from tokenselect.attention import Chunk, RopeFrequencies, rows
from tokenselect.kernels import get_kernels
from tokenselect.kv_cache import KVCache
from tokenselect.rope import RopeSpec
from tokenselect.policies import SeqStep, start_step
from tokenselect.policies.full import FullAttention
from tokenselect.policies.infllm import InfLLM
from tokenselect.policies.quest import Quest
from tokenselect.policies.reattention import ReAttention
from tokenselect.policies.streaming import StreamingLLM
from tokenselect.policies.tokenselect import TokenSelect

from checkpoints import distinct_tokens, small_sizes

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TORCH = get_kernels("torch")
SIZES = dict(n_init=4, n_local=12)
POLICIES = {
    "tokenselect": lambda cache: TokenSelect(cache, TORCH, k=16, theta=0.5, **SIZES),
    "tokenselect:topk": lambda cache: TokenSelect(cache, TORCH, k=16, theta=0.5, selector="topk", **SIZES),
    "tokenselect:theta=None": lambda cache: TokenSelect(cache, TORCH, k=16, theta=None, **SIZES),
    "tokenselect:original": lambda cache: TokenSelect(cache, TORCH, k=16, theta=0.5, positions="original", **SIZES),
    "streaming": lambda cache: StreamingLLM(cache, TORCH, **SIZES),
    "full": lambda cache: FullAttention(cache, TORCH),
    "reattention": lambda cache: ReAttention(cache, TORCH, window=1000, chunk=10, span=3, n_spans=4, top=2, **SIZES),
    "quest": lambda cache: Quest(cache, TORCH, k=16, page_size=4, **SIZES),
    "infllm": lambda cache: InfLLM(cache, TORCH, window=1000, chunk=10, k=8, block_size=4, **SIZES),
    "infllm:reindex": lambda cache: InfLLM(cache, TORCH, window=1000, chunk=10, k=8, block_size=4,
                                           positions="reindex", **SIZES),
    "infllm:original": lambda cache: InfLLM(cache, TORCH, window=1000, chunk=10, k=8, block_size=4,
                                            positions="original", **SIZES),
}


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def padded_step(policy, seq_id: int, table: torch.Tensor, t: int, w: int, decode: bool, capacity: int) -> SeqStep:
    """A step as ``GraphCache.run_whole`` feeds it: the table's first ``capacity`` slots (the sequence's t + w tokens, then
    slots that are not the sequence's), the length and the row as device scalars."""
    q_shape = (w, 4, 16)
    row = policy.prepare(seq_id, table, t, capacity, decode, q_shape, torch.float32)
    return SeqStep(table[:capacity], torch.tensor(t, device=table.device), torch.tensor(row, device=table.device),
                   decode, policy.mode(t, w), policy.step_buffers(seq_id))


def live(got) -> tuple[list, list]:
    n = got.slots.numel() if got.n_valid is None else int(got.n_valid)
    return got.slots[:n].tolist(), got.key_pos[:n].tolist()


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_padded_table_gives_what_the_exact_table_gives(name):
    """What a policy attends does not depend on the table's length past the sequence's tokens: a graph's table is
    padded to its capacity, an eager step's is exact. Two layers, a prompt in chunks and then decode steps (Selection
    Cache hits and misses, InfLLM's blocks closing), each step run by two instances of the policy on the two tables."""
    torch.manual_seed(7)
    layers, n = 2, 160
    cache = KVCache(layers, 300, 2, 16, torch.float32, torch.device("cpu"))
    table = cache.allocate(300)[torch.randperm(300)]
    for layer in range(layers):
        cache.write(layer, table, torch.randn(300, 2, 16), torch.randn(300, 2, 16))
    exact, padded = POLICIES[name](cache), POLICIES[name](cache)
    steps = [(t, 10, False) for t in range(0, 100, 10)] + [(t, 1, True) for t in range(100, 130)]
    selected = 0
    for t, w, decode in steps:
        qs = [torch.randn(w, 4, 16) for _ in range(layers)]
        if decode and t % 3:  # near the last query: a Selection Cache hit where theta allows
            qs = [q + 0.01 * torch.randn_like(q) for q in qs]
        own = table[t:t + w]
        a = start_step(exact, 0, table, t, w, decode, (w, 4, 16), torch.float32)
        b = padded_step(padded, 0, table, t, w, decode, capacity=n)
        assert a.mode == b.mode
        selected += a.mode == "select"
        for layer in range(layers):
            got_a, got_b = exact.attend(layer, a, qs[layer], own), padded.attend(layer, b, qs[layer], own)
            assert live(got_a) == live(got_b), (t, layer)
            assert got_a.q_pos.tolist() == got_b.q_pos.tolist()
            assert set(own.tolist()) <= set(live(got_a)[0])  # the step's own tokens are attended
    assert selected >= 30 or name == "full"
    assert exact.stats() == padded.stats()


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_steps_read_nothing_on_the_host(name):
    """What a step runs (``attend``, with the PyTorch reference kernels) never reads a device value on the host,
    which a CUDA graph capture refuses: on the meta device, where a tensor has no values, any such read raises.
    (Indexing with a device scalar does read it: InfLLM's first pool layout failed to record on the H100 that way.)
    Prefill chunks before and past the selection threshold, then decode steps, of every graph-ready policy."""
    meta, layers, n_heads, d = torch.device("meta"), 2, 4, 16
    cache = KVCache(layers, 400, 2, d, torch.float32, meta)
    slots = cache.allocate(300)
    policy = POLICIES[name](cache)
    for t, w, decode in [(t, 10, False) for t in range(0, 80, 10)] + [(80, 1, True), (81, 1, True)]:
        step = start_step(policy, 0, slots, t, w, decode, (w, n_heads, d), torch.float32)
        for layer in range(layers):
            got = policy.attend(layer, step, torch.randn(w, n_heads, d, device=meta), slots[t:t + w])
            assert got.slots.device == meta and got.q_pos.shape == (w,)
    assert policy.graph_ready(80)


def test_dynamic_ntk_frequencies_follow_the_last_query_without_a_host_read():
    """Dynamic NTK's frequencies grow with the length attended, read from the step's last query position on the
    device: on the meta device (no values) a host read would raise, so its steps can be recorded whole. On a
    CPU they equal the host formula's (``RopeSpec.inv_freq``, matched to transformers in test_rope) for the last
    query's position + 1, and stay the window's at and below it."""
    spec = RopeSpec(16, theta=10000.0, kind="dynamic", factor=4.0, max_position=256)
    frequencies = RopeFrequencies(spec, torch.device("meta"))
    inv_freq, scale = frequencies(torch.arange(300, device="meta"))
    assert inv_freq.device.type == "meta" and inv_freq.shape == (8,) and scale == 1.0
    on_cpu = RopeFrequencies(spec, torch.device("cpu"))
    window = spec.inv_freq(0)[0]
    for last in (0, 254, 255, 256, 700):  # the first past the window: position 256, i.e. 257 tokens
        got = on_cpu(torch.tensor([3, last]))[0]
        want = spec.inv_freq(last + 1)[0]
        assert torch.equal(got, want)
        assert torch.equal(got, window) is (last + 1 <= 256)


def test_a_batchs_operands_are_views_where_they_can_be():
    """``attention.rows``: the rows of one slot table are a strided view of it (no copy a layer), one shared arange
    a stride-0 view, and anything else a stack; each row reads what its tensor held."""
    table = torch.arange(40).view(4, 10)
    got = rows([table[b, 2:9] for b in range(4)])
    assert got.data_ptr() == table[0, 2:9].data_ptr() and got.stride() == (10, 1)
    assert torch.equal(got, table[:, 2:9])
    shared = torch.arange(6)
    got = rows([shared[1:5]] * 3)
    assert got.stride() == (0, 1) and torch.equal(got, shared[1:5].expand(3, 4))
    apart = [torch.arange(3) + b for b in range(2)]  # separate tensors: a stack
    got = rows(apart)
    assert torch.equal(got, torch.stack(apart)) and got.data_ptr() not in [t.data_ptr() for t in apart]
    reversed_rows = rows([table[1], table[0]])  # rows of one table, but not in order: a stack
    assert torch.equal(reversed_rows, table[[1, 0]])


def test_a_grown_arange_keeps_the_one_graphs_read():
    """Steps and graphs take index runs from one arange of the cache (``KVCache.arange``). When a longer one is
    needed the shorter must stay allocated: a recorded CUDA graph reads it by address, and freed memory would be
    handed to the next allocation of its size."""
    aranges = KVCache(1, 8, 1, 4, torch.float32, torch.device("cpu")).arange
    address = aranges(1).data_ptr()
    size = aranges.kept[-1].numel()
    grown = aranges(size + 1)
    assert torch.equal(grown, torch.arange(size + 1)) and grown.data_ptr() != address
    assert address in [kept.data_ptr() for kept in aranges.kept]  # still allocated: nothing can reuse it
    assert KVCache(1, 8, 1, 4, torch.float32, torch.device("cpu")).arange is not aranges  # no state shared


def test_quest_records_its_decode_graph_again_when_its_bounds_grow(tiny_llama, monkeypatch):
    """QUEST's page bounds grow with the context (``prepare`` doubles their page axis: new tensors); a recorded graph
    reads the old ones by address, so the step that grows them records its graph again (``graph_reads``), and the
    steps in between replay it."""
    llm = LLM(tiny_llama, "quest", chunk_size=32, cuda_graphs=True, dtype="float32", k=16, page_size=4,
              **small_sizes("quest"))
    records = []
    real = cuda_graphs._WholeStep.record
    monkeypatch.setattr(cuda_graphs._WholeStep, "record", lambda self: (records.append(1), real(self))[1])
    seq = llm.add_request(ids(70, 5), SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
    while seq.prefilling:
        llm.step()
    grown = recorded = replayed = 0
    while not seq.finished:
        bounds, before = llm.policy.lo.data_ptr(), len(records)
        steps, passes = llm.runner.graphs.whole_steps, llm.runner.passes
        llm.step()
        new_tensor, new_graph = llm.policy.lo.data_ptr() != bounds, len(records) > before
        # every decode pass through the whole-step graph (a call queues 0-2 of them: ``overlap_decode``)
        assert llm.runner.graphs.whole_steps - steps == llm.runner.passes - passes
        assert not new_tensor or new_graph  # grown bounds: recorded again, never a replay of the old graph
        grown, recorded, replayed = grown + new_tensor, recorded + new_graph, replayed + (not new_graph)
    assert grown >= 1 and replayed > 40  # the bounds grew mid-decode (page 22 at token 112), the rest replayed
    assert recorded == grown + 1  # the first decode step's graph, and one more per growth


def test_a_recorded_step_is_judged_by_what_it_changed_in_the_state():
    """The record check compares the replay's change of the policy's state with the eager step's: a ring entry
    the replay put in the wrong place is caught although it is tiny beside the ring's norm; integer state
    must match exactly; rounding passes."""
    before = [torch.rand(64, 32) * 50, torch.tensor([3, 4])]
    eager = [before[0].clone(), before[1] + torch.tensor([0, 1])]
    eager[0][7] += 0.3
    replay = [eager[0] + 1e-7, eager[1].clone()]
    assert cuda_graphs._same_change(replay, before, eager)
    wrong = [before[0].clone(), eager[1].clone()]
    wrong[0][8] += 0.3  # the same mass, one entry off
    assert cuda_graphs._same(wrong[0], eager[0])  # the whole tensors alone would not tell
    assert not cuda_graphs._same_change(wrong, before, eager)
    assert not cuda_graphs._same_change([eager[0].clone(), before[1].clone()], before, eager)  # a count missed


def test_every_layer_of_a_step_shares_one_list_assembled_once():
    """A step's SeqStep serves all its layers: the sinks, the local window and the step's own slots are put in
    one list by the first layer (graph nodes once a step, not once a layer), and each layer writes only its own
    choice into that list's middle, which its attention then reads."""
    torch.manual_seed(5)
    cache = KVCache(2, 300, 2, 16, torch.float32, torch.device("cpu"))
    slots = cache.allocate(300)[torch.randperm(300)]
    cache.write(0, slots, torch.randn(300, 2, 16), torch.randn(300, 2, 16))
    cache.write(1, slots, torch.randn(300, 2, 16), torch.randn(300, 2, 16))
    policy = TokenSelect(cache, TORCH, k=16, n_init=4, n_local=32, theta=None)
    step = start_step(policy, 0, slots, 250, 1, True, (1, 4, 16), torch.float32)
    q = torch.randn(1, 4, 16)
    frames, chosen = [], []
    for layer in (0, 1):
        got = policy.attend(layer, step, q, slots[250:251])
        middle = slots[4:251 - 32]
        chosen.append(policy.top(q[0], cache.k[layer], middle[:250 - 36]))  # the layer's own choice
        assert got.slots.tolist() == slots[:4].tolist() + middle[chosen[-1]].tolist() + slots[218:251].tolist()
        frames.append(got.slots)
    assert frames[0].data_ptr() == frames[1].data_ptr()  # one list, its middle rewritten by layer 1
    assert not torch.equal(chosen[0], chosen[1])
    key, = [key for key, value in step._derived.items() if value is frames[0]]  # kept by the step's SeqStep
    made = []
    assert step.once(key, lambda: made.append(1)) is frames[0] and not made


@pytest.mark.parametrize("w", [1, 8])  # a decode token, a prefill chunk
def test_full_attention_is_the_table_live_up_to_the_steps_own_tokens(w):
    """Full attention's list is the whole fixed table; its live prefix (the cached tokens, then the step's own)
    holds them at their own positions, the queries at theirs."""
    cache = KVCache(1, 300, 2, 16, torch.float32, torch.device("cpu"))
    table = cache.allocate(300)[torch.randperm(300)]
    t = 250
    policy = FullAttention(cache, TORCH)
    assert policy.graph_ready(0) and policy.graph_ready(t)
    step = padded_step(policy, 0, table, t, w, w == 1, capacity=300)
    got = policy.attend(0, step, torch.randn(w, 4, 16), table[t:t + w])
    assert got.slots.numel() == got.key_pos.numel() == 300 and int(got.n_valid) == t + w
    assert torch.equal(got.slots, table) and got.key_pos.tolist() == list(range(300))
    assert got.q_pos.tolist() == list(range(t, t + w))


def test_which_decode_steps_run_as_whole_graphs(tiny_llama):
    """Decode steps of a graph-ready policy (past its selection threshold, or attending everything as full attention
    does: TokenSelect inside ``dense_until``); the rest take the pieces."""
    llm = LLM(tiny_llama, "full", chunk_size=32, cuda_graphs=True)
    sizes = {"n_init": 4, "n_local": 16, "dense_until": 0}
    for policy, settings, works in (("tokenselect", {"k": 16, **sizes}, True), ("streaming", sizes, True),
                                    ("tokenselect", {"k": 16, **sizes, "dense_until": 200}, True),
                                    ("full", {}, True),
                                    ("quest", {"k": 16, "page_size": 4, **sizes}, True),
                                    ("infllm", {"k": 16, "block_size": 4, **sizes}, True),
                                    # inside InfLLM's threshold (4 + 128 + 3 + 16 tokens): every token, as full
                                    # attention
                                    ("infllm", {"k": 128, "block_size": 4, **sizes}, True)):
        llm.set_attention(policy, **settings)
        seqs = [llm.add_request(ids(80, i), SamplingParams(max_tokens=3, ignore_eos=True)) for i in range(2)]
        while any(s.prefilling for s in seqs):
            llm.step()
        decode = [Chunk(s, i, 1, s.n_cached) for i, s in enumerate(seqs)]
        assert llm.runner.graphs.whole(decode) is works, policy
        batch = decode * (cuda_graphs.MAX_BATCH // 2)  # the same two sequences' rows, as many as a graph takes
        assert cuda_graphs.MAX_BATCH == cuda_graphs.DECODE_BUCKETS[-1] == 64
        assert llm.runner.graphs.whole(batch) is works and not llm.runner.graphs.whole(batch + decode[:1])
        assert not llm.runner.graphs.whole([Chunk(seqs[0], 0, 2, seqs[0].n_cached)])  # two tokens
        assert not llm.runner.graphs.whole([Chunk(seqs[0], 0, 1, 20)])  # inside the threshold / a prompt
        for s in seqs:
            llm.abort(s)
    # original positions are computed on the device from the step's length, so they record like re-indexed ones; a
    # batch of one sequence inside dense_until (attending everything) and one past it (selecting) does not
    llm.set_attention("tokenselect", positions="original", k=16, n_init=4, n_local=16, dense_until=85)
    seqs = [llm.add_request(ids(n, 9), SamplingParams(max_tokens=3, ignore_eos=True)) for n in (80, 90)]
    while any(s.prefilling for s in seqs):
        llm.step()
    decode = [Chunk(s, i, 1, s.n_cached) for i, s in enumerate(seqs)]
    assert [llm.policy.mode(ch.past, 1) for ch in decode] == ["all", "select"]
    assert llm.runner.graphs.whole(decode[:1]) and llm.runner.graphs.whole(decode[1:])
    assert not llm.runner.graphs.whole(decode)
    for s in seqs:
        llm.abort(s)


@pytest.mark.parametrize("positions", ["fixed", "reindex"])
def test_infllm_decode_inside_its_threshold_through_whole_graphs(tiny_llama, batch_invariant_matmuls, positions):
    """InfLLM's decode steps before it selects attend every token (inside the model's 256-token window at their own
    positions; past it, with the fixed scheme, the memory at one position): one graph per mode, as full attention's;
    the tokens, and the local scores each step counts into the ring (which the blocks' representatives come from
    once it selects), are the plain path's. (Its prefill chunks there: ``test_prefill_through_whole_graphs_...``.)"""
    settings = dict(n_init=4, n_local=16, k=320, block_size=4, repr_keys=2, positions=positions)  # selects past 343
    engines = [LLM(tiny_llama, "infllm", chunk_size=32, cuda_graphs=graphs, dtype="float32", **settings)
               for graphs in (False, True)]
    prompt = distinct_tokens(240, 12)
    seqs, modes = [], []
    for llm in engines:
        seqs.append(llm.add_request(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)))
        while seqs[-1].prefilling:
            llm.step()
        before = llm.runner.graphs.whole_steps if llm.runner.graphs is not None else 0
        while seqs[-1].n_cached < 240 + 29:  # stopped before the end: the sequence keeps its memory
            modes.append(llm.policy.mode(seqs[-1].n_cached, 1))
            assert llm.policy.graph_ready(seqs[-1].n_cached, 1)
            llm.step()
    assert seqs[1].output_ids == seqs[0].output_ids
    graphs = engines[1].runner.graphs
    assert graphs.whole_steps - before == 29 and graphs.failure is None  # every decode step (240..268)
    want = {"all", "all, fixed"} if positions == "fixed" else {"all"}  # past the window from 256 on
    assert set(modes) == want and {key[-1] for key in graphs.whole_keys()} == want
    (plain, graphed), last = [llm.policy for llm in engines], 240 + 29  # 4 .. 268 have ring entries
    for layer in range(engines[0].model.config.n_layers):
        ring = torch.arange(4, last) % plain.ring
        torch.testing.assert_close(graphed.mass[graphed._memory[seqs[1].id].row, layer, ring],
                                   plain.mass[plain._memory[seqs[0].id].row, layer, ring], rtol=1e-4, atol=1e-6)


def test_which_prefill_chunks_run_as_whole_graphs(tiny_llama, monkeypatch):
    """A prompt of at least PREFILL_MIN_CHUNKS x chunk_size tokens runs its full chunks as whole steps, alone in the
    step: those inside the selection threshold (attending everything) through one graph, those past it through
    another; its last partial chunk, shorter prompts and chunks sharing a step with a decode token take the pieces."""
    monkeypatch.setattr(cuda_graphs, "PREFILL_MIN_CHUNKS", 4)
    llm = LLM(tiny_llama, "tokenselect", chunk_size=32, k=16, n_init=4, n_local=16, dense_until=0,
              cuda_graphs=True)
    graphs = llm.runner.graphs
    seq = llm.add_request(ids(150, 1), SamplingParams(max_tokens=2, ignore_eos=True))
    usable = []
    while seq.prefilling:
        usable.append(graphs.whole([Chunk(seq, 0, min(32, 150 - seq.n_cached), seq.n_cached)]))
        llm.step()
    assert usable == [True, True, True, True, False]  # past 0, 32 (inside 4 + 16 + 16), 64, 96; not the last 22 rows
    assert graphs.whole_steps == 4
    assert [(key[0], key[-1]) for key in graphs.whole_keys()] == [("prefill", "all"), ("prefill", "select")]
    short = llm.add_request(ids(127, 2), SamplingParams(max_tokens=2, ignore_eos=True))  # under 4 x 32 tokens
    assert not graphs.whole([Chunk(short, 0, 32, 64)])
    other = llm.add_request(ids(128, 3), SamplingParams(max_tokens=2, ignore_eos=True))
    assert graphs.whole([Chunk(other, 0, 32, 64)])  # alone in its step: yes; beside a decode token: no
    assert not graphs.whole([Chunk(seq, 0, 1, seq.n_cached), Chunk(other, 1, 32, 64)])


@pytest.mark.parametrize("attention,settings", [("tokenselect", {"theta": 0.5}),
                                                ("tokenselect", {"theta": None, "selector": "topk"}),
                                                ("tokenselect", {"theta": 0.5, "neighbours": 2}),
                                                ("streaming", {}), ("full", {}),
                                                ("infllm", {"k": 16, "block_size": 4, "repr_keys": 2}),
                                                ("infllm", {"k": 16, "block_size": 4, "positions": "original"}),
                                                ("quest", {"k": 16, "page_size": 4})])
def test_prefill_through_whole_graphs_gives_the_plain_paths_logits(tiny_llama, batch_invariant_matmuls, monkeypatch,
                                                                   attention, settings):
    """Every prompt position's logits, and then the generated tokens, are the plain path's when the prompt's
    chunks run as whole steps; the Selection Cache then decodes with the same hits and misses."""
    monkeypatch.setattr(cuda_graphs, "PREFILL_MIN_CHUNKS", 4)
    sizes = small_sizes(attention)
    engines = [LLM(tiny_llama, attention, chunk_size=32, cuda_graphs=graphs, dtype="float32", **sizes, **settings)
               for graphs in (False, True)]
    prompt = distinct_tokens(200, 6)  # the graph's padded span must not break ties another way
    logits = [llm.prompt_logits(prompt) for llm in engines]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
    # every full chunk (0, 32, ..., 160; not the last 8 tokens), those inside the selection threshold (4 + 16 + 16
    # tokens, streaming's 4 + 16, InfLLM's 4 + (4 * 4 + 3) + 16) attending everything through a graph of their own
    assert engines[1].runner.graphs.whole_steps == 6
    modes = {"full": 1}.get(attention, 2)  # graphs: one per mode the prompt's chunks take
    again = distinct_tokens(190, 7)  # another prompt of the same table capacity: the recorded graph again
    torch.testing.assert_close(engines[1].prompt_logits(again), engines[0].prompt_logits(again), rtol=1e-4, atol=1e-4)
    assert len([key for key in engines[1].runner.graphs.whole_keys() if key[0] == "prefill"]) == modes
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    outs = [llm.generate([prompt], params)[0].token_ids for llm in engines]
    assert outs[1] == outs[0]
    counts = [{k: v for k, v in llm.stats().items() if k.startswith("selection_cache")} for llm in engines]
    assert counts[1] == counts[0]


@pytest.mark.parametrize("positions", ["fixed", "original"])
def test_infllm_prefill_through_whole_graphs_keeps_the_eager_memory(tiny_llama, batch_invariant_matmuls, monkeypatch,
                                                                    positions):
    """A prompt whose full chunks run as whole steps leaves InfLLM's memory as the plain path leaves it: every
    layer's block representatives and local scores, from attention counted out of what the graphs saved."""
    monkeypatch.setattr(cuda_graphs, "PREFILL_MIN_CHUNKS", 4)
    settings = dict(small_sizes("infllm"), k=16, block_size=4, repr_keys=2, positions=positions)
    engines = [LLM(tiny_llama, "infllm", chunk_size=32, cuda_graphs=graphs, dtype="float32", **settings)
               for graphs in (False, True)]
    seqs = []
    for llm in engines:
        seqs.append(llm.add_request(distinct_tokens(200, 11), SamplingParams(max_tokens=3, ignore_eos=True)))
        while seqs[-1].prefilling:
            llm.step()
    # every full chunk, 0 and 32 (inside the threshold: every token) too; the last 8 tokens take the pieces
    assert engines[1].runner.graphs.whole_steps == 6
    (plain, graphed), last = [llm.policy for llm in engines], 192  # the last chunk's attention is still pending
    for layer in range(engines[0].model.config.n_layers):
        want = plain.representatives(seqs[0].id, layer)
        assert want.shape[0] == (last - 4 - 16) // 4
        torch.testing.assert_close(graphed.representatives(seqs[1].id, layer), want, rtol=1e-4, atol=1e-5)
        mem = plain._memory[seqs[0].id]
        ring = torch.arange(plain.tracked_from(mem.layers[layer]), last) % plain.ring
        torch.testing.assert_close(graphed.mass[graphed._memory[seqs[1].id].row, layer, ring],
                                   plain.mass[mem.row, layer, ring], rtol=1e-4, atol=1e-5)


def test_full_attention_through_whole_graphs_with_the_triton_kernels(tiny_llama, monkeypatch):
    """The Triton attention reading its live length on the device (the table is longer: GRAIN rounds it up)
    gives the plain path's prompt logits and tokens, prefill chunks and decode steps alike."""
    monkeypatch.setattr(cuda_graphs, "PREFILL_MIN_CHUNKS", 4)
    engines = [LLM(tiny_llama, "full", chunk_size=32, cuda_graphs=graphs, dtype="float32", kernels="triton")
               for graphs in (False, True)]
    prompt = distinct_tokens(150, 8)
    torch.testing.assert_close(engines[1].prompt_logits(prompt), engines[0].prompt_logits(prompt),
                               rtol=1e-4, atol=1e-4)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    before = engines[1].runner.graphs.whole_steps
    outs = [llm.generate([prompt], params)[0].token_ids for llm in engines]
    assert outs[1] == outs[0]
    assert engines[1].runner.graphs.whole_steps - before == 4 + 4  # 4 full prefill chunks (of 150), 4 decode steps


@pytest.mark.parametrize("neighbours", [0, 2])
def test_tokenselect_through_whole_graphs_with_the_triton_kernels(tiny_llama, neighbours):
    """Decode graphs with the Triton kernels (the vote, its spread over neighbours, the top-k gated by the Selection
    Cache's decision, its store-or-reuse kernel, the attention) decode the plain path's tokens with the same hits and
    misses."""
    engines = [LLM(tiny_llama, "tokenselect", chunk_size=32, cuda_graphs=graphs, dtype="float32", kernels="triton",
                   theta=0.0, neighbours=neighbours, **small_sizes("tokenselect")) for graphs in (False, True)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompt = distinct_tokens(100, 9)
    outs = [llm.generate([prompt], params)[0].token_ids for llm in engines]
    assert outs[1] == outs[0]
    stats = [llm.stats() for llm in engines]
    assert engines[1].runner.graphs.whole_steps >= 9  # every decode step after the first
    for key in ("selection_cache_hits", "selection_cache_misses"):
        assert stats[1][key] == stats[0][key] > 0


@pytest.mark.parametrize("attention,settings", [
    ("tokenselect", {"theta": 0.5}),
    ("tokenselect", {"theta": None, "selector": "topk"}),
    ("tokenselect", {"theta": -1.0}),
    ("tokenselect", {"theta": 0.5, "select_dtype": "fp8"}),
    ("tokenselect", {"theta": 0.5, "neighbours": 2}),
    ("streaming", {}),
    ("full", {}),
    ("infllm", {"k": 16, "block_size": 4, "repr_keys": 2}),
    ("infllm", {"k": 16, "block_size": 4, "repr_keys": 2, "positions": "original"}),
    ("quest", {"k": 16, "page_size": 4}),
    ("quest", {"k": 16, "page_size": 4, "positions": "original"}),
])
def test_engine_generates_the_plain_paths_tokens(tiny_llama, batch_invariant_matmuls, monkeypatch, attention, settings):
    """Requests arriving at different times (so steps alternate between decode graphs and mixed steps
    with a prefill chunk, and the batch size changes) decode what the plain path decodes, with the same
    Selection Cache hits and misses. A small GRAIN makes the tables outgrow their capacity mid-run."""
    monkeypatch.setattr(cuda_graphs, "GRAIN", 16)
    sizes = small_sizes(attention)
    engines = [LLM(tiny_llama, attention, chunk_size=32, cuda_graphs=graphs, dtype="float32", **sizes, **settings)
               for graphs in (False, True)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    outputs = []
    for llm in engines:
        first = [llm.add_request(ids(70, 1), params), llm.add_request(ids(45, 2), params)]
        for _ in range(8):
            llm.step()
        late = llm.add_request(ids(90, 3), params)
        while not all(s.finished for s in first + [late]):
            llm.step()
        outputs.append(([s.output_ids for s in first + [late]], llm.stats()))
    (want, plain), (got, graphed) = outputs
    assert got == want
    assert engines[1].runner.graphs.failure is None  # on a GPU: every recorded graph passed its check
    steps = engines[1].runner.graphs.whole_keys()
    assert steps and all(key[2] % 16 == 0 for key in steps)
    if attention == "tokenselect" and settings["theta"] is not None:
        assert graphed["selection_cache_hits"] == plain["selection_cache_hits"]
        assert graphed["selection_cache_misses"] == plain["selection_cache_misses"]
        assert graphed["selection_cache_misses"] > 0
        assert (graphed["selection_cache_hits"] > 0) is True


def test_a_batch_past_eight_sequences_decodes_through_one_graph(tiny_llama, batch_invariant_matmuls):
    """Twelve requests decoding together (past the 8 a graph once took) run as one whole-step graph a step and decode
    what the plain path decodes, with the same Selection Cache decisions."""
    sizes = small_sizes("tokenselect")
    engines = [LLM(tiny_llama, "tokenselect", chunk_size=32, cuda_graphs=graphs, dtype="float32", theta=0.5, **sizes)
               for graphs in (False, True)]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)  # the early ones still decode when the
    # last prompt's chunks are in (a step with a prefill chunk runs through the pieces)
    outs = [[o.token_ids for o in llm.generate([ids(60 + i, 30 + i) for i in range(12)], params, use_tqdm=False)]
            for llm in engines]
    assert outs[1] == outs[0]
    assert 12 in [key[1] for key in engines[1].runner.graphs.whole_keys() if key[0] == "decode"]
    # every stat but the pool's size, which an engine takes from the memory it finds free (other processes on the GPU)
    stats = [{k: v for k, v in llm.stats().items() if k not in ("kv_slots", "kv_slots_free")} for llm in engines]
    assert stats[1] == stats[0]
    used = [llm.cache.n_slots - llm.cache.num_free for llm in engines]
    assert used[1] == used[0]


@pytest.mark.parametrize("attention", ["full", "tokenselect"])
def test_dynamic_ntk_decodes_through_whole_graphs(tiny_llama, batch_invariant_matmuls, attention):
    """Dynamic NTK (its frequencies follow each step's length, computed on the device) decodes through whole-step
    graphs, prefill chunks too, with the plain path's tokens, while the requests cross the model's 256-token
    window and after; without the scaling the tokens differ, so the frequencies took part (TokenSelect at its
    tokens' own positions: re-indexed ones stay inside the window, where dynamic NTK changes nothing)."""
    sizes = {**small_sizes(attention), "positions": "original"} if attention == "tokenselect" else {}
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [ids(240, 40), ids(300, 41)]  # the first crosses the window while it decodes

    def run(graphs: bool, scaling: str | None):
        llm = LLM(tiny_llama, attention, chunk_size=32, cuda_graphs=graphs, dtype="float32", rope_scaling=scaling,
                  **sizes)
        return llm, [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    (_, want), (graphed, got) = run(False, "dynamic:4"), run(True, "dynamic:4")
    assert got == want
    assert graphed.runner.graphs.failure is None
    assert 2 in [key[1] for key in graphed.runner.graphs.whole_keys() if key[0] == "decode"]
    assert run(False, None)[1] != want


def test_the_next_prompt_replays_infllm_prefill_graph(tiny_llama, monkeypatch):
    """A prefill graph writes the chunk's queries and lists into its sequence's buffers; a finished prompt's buffers
    pass to the next prompt, so that its chunks replay the graph recorded for the first (no recording per prompt).
    Without the prefix cache: its snapshots of InfLLM's memory hold pool blocks, so the next prompt's graph step,
    which reserves blocks for its whole padded table, grows the pool (and records the graph again) now and then."""
    monkeypatch.setattr(cuda_graphs, "PREFILL_MIN_CHUNKS", 4)
    llm = LLM(tiny_llama, "infllm", chunk_size=32, cuda_graphs=True, dtype="float32", prefix_cache=False,
              **dict(small_sizes("infllm"), k=16, block_size=4))
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    recorded = []
    for seed in (1, 2):
        llm.generate([ids(200, seed)], params)
        recorded.append({key: step for key, step in llm.runner.graphs.graphs.items() if key[0] == "prefill"})
    assert recorded[0] and all(recorded[1][key] is step for key, step in recorded[0].items())


def test_a_sequence_keeps_its_selection_cache_entry_across_paths(tiny_llama):
    """theta = -1 hits whenever an entry exists: one miss per layer for the whole request, however its
    decode steps alternate between the graph and the eager path."""
    llm = LLM(tiny_llama, "tokenselect", chunk_size=32, k=16, n_init=4, n_local=16, theta=-1.0, dense_until=0,
              cuda_graphs=True)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    seq = llm.add_request(ids(70, 4), params)
    while seq.prefilling:
        llm.step()
    for _ in range(3):  # decode graphs alone
        llm.step()
    other = llm.add_request(ids(100, 5), params)  # its prefill chunks make the next steps mixed (eager)
    while not seq.finished:
        llm.step()
    llm.abort(other)
    assert llm.stats()["selection_cache_misses"] == 2 * 2  # 2 layers; the other request's first decode too


@pytest.mark.skipif(not torch.cuda.is_available(), reason="records CUDA graphs")
# the step's cache rows restored on the host too, and in the selection keys' copy
@pytest.mark.parametrize("kv_offload,select_dtype", [("none", "auto"), ("values", "auto"), ("none", "fp8")])
def test_a_graph_whose_replay_differs_from_the_eager_step_is_turned_off(tiny_llama, batch_invariant_matmuls,
                                                                        monkeypatch, kv_offload, select_dtype):
    """A graph that leaves work out (here: under capture the policy returns its stored selection without
    checking or selecting, as a host read baked into the graph would) fails its check: a warning, whole-step
    graphs off for good, and the tokens of the plain path all the same."""
    honest = TokenSelect.choose

    def choose(self, layer, step, q):
        if torch.cuda.is_current_stream_capturing() and step.decode:
            return self.selection_cache.selection[:, layer].index_select(0, step.row.view(1))[0], None
        return honest(self, layer, step, q)

    monkeypatch.setattr(TokenSelect, "choose", choose)
    settings = dict(chunk_size=32, k=16, n_init=4, n_local=16, theta=0.5, dense_until=0, dtype="float32")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    settings["select_dtype"] = select_dtype
    want = LLM(tiny_llama, "tokenselect", cuda_graphs=False, **settings).generate([ids(70, 1)], params)
    graphed = LLM(tiny_llama, "tokenselect", cuda_graphs=True, kv_offload=kv_offload, **settings)
    with pytest.warns(UserWarning, match="whole-step CUDA graphs turned off"):
        got = graphed.generate([ids(70, 1)], params)
    assert got[0].token_ids == want[0].token_ids
    assert graphed.runner.graphs.failure.startswith("the replay") and not graphed.runner.graphs.whole_keys()


def test_requests_with_their_own_settings_decode_as_the_plain_path(tiny_llama, batch_invariant_matmuls):
    """Two requests with different per-request settings (two policy instances) cannot share a graph:
    their joint steps take the pieces; once one has finished, the other's steps run as decode graphs."""
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (6, 16)]
    own = [{"theta": 0.5}, {"theta": -1.0, "k": 24}]
    outputs = []
    for graphs in (False, True):
        llm = LLM(tiny_llama, "tokenselect", chunk_size=32, k=16, n_init=4, n_local=16, dense_until=0, dtype="float32",
                  cuda_graphs=graphs)
        seqs = [llm.add_request(ids(80 + 10 * i, 20 + i), p, s) for i, (p, s) in enumerate(zip(params, own))]
        while not all(s.finished for s in seqs):
            llm.step()
        outputs.append([s.output_ids for s in seqs])
        if graphs:
            assert [key[1] for key in llm.runner.graphs.whole_keys()] == [1]  # the longer request alone
    assert outputs[0] == outputs[1]


def test_a_batch_of_tokenselect_decode_steps_selects_in_one_launch_a_layer(tiny_llama, batch_invariant_matmuls):
    """Six requests decoding together, eagerly and through whole steps: the Selection Cache's check and update, the
    vote and the top-k run once a layer for the decoding sequences together (their operands [B, ...]), in the steps
    that also prefill another prompt's chunk too (eager ones), and make the choices each request makes alone: the
    same tokens, the same decisions, and as many sequences' votes (each batched call counting its rows)."""
    sizes = small_sizes("tokenselect")
    prompts = [ids(70 + 9 * i, 50 + i) for i in range(6)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    runs = {}
    for name, graphs in (("alone", False), ("eager", False), ("graphs", True)):
        llm = LLM(tiny_llama, "tokenselect", chunk_size=32, cuda_graphs=graphs, dtype="float32", theta=0.5, **sizes)
        seen = {"vote": [], "topk": [], "check": [], "update": []}
        policy, sc = llm.policy, llm.policy.selection_cache

        def counted(fn, name, dims, seen=seen):
            def run(*a, **k):
                seen[name].append(a[0].shape[0] if a[0].dim() == dims else 1)
                return fn(*a, **k)
            return run
        policy.kernels = dataclasses.replace(policy.kernels, head_soft_vote=counted(policy.kernels.head_soft_vote,
                                                                                     "vote", 3),
                                             topk=counted(policy.kernels.topk, "topk", 2))
        sc.check, sc.update_kernel = counted(sc.check, "check", 2), counted(sc.update_kernel, "update", 2)
        batches = [prompts] if name != "alone" else [[p] for p in prompts]
        tokens = [o.token_ids for batch in batches for o in llm.generate(batch, params, use_tqdm=False)]
        runs[name] = tokens, llm.policy.stats(), seen, llm
    alone = runs["alone"]
    assert max(alone[2]["vote"]) == 1
    layers = alone[3].model.config.n_layers
    for name in ("eager", "graphs"):
        tokens, stats, seen, llm = runs[name]
        assert tokens == alone[0] and stats == alone[1], name  # the same tokens and Selection Cache decisions
        # a CUDA graph replays its kernels without calling their Python wrappers: there only the recording counts
        replayed = name == "graphs" and DEVICE.type == "cuda"
        for kernel in ("vote", "topk", "check", "update"):
            if replayed:
                assert max(seen[kernel]) >= 6, kernel  # the batch recorded in one launch a layer
            else:
                assert sum(seen[kernel]) == sum(alone[2][kernel]), (name, kernel)  # the same selections ...
                assert seen[kernel].count(6) >= 4 * layers, (name, kernel)  # ... six at once, in many steps
            assert len(seen[kernel]) < len(alone[2][kernel]), (name, kernel)
    mixed = [b for b in runs["eager"][2]["vote"] if 1 < b < 6]  # decodes beside a later prompt's prefill chunk
    assert len(mixed) >= 2 * layers


@pytest.mark.parametrize("batch", [1, 4])
def test_full_attention_batch_reads_its_positions_and_lengths_in_place(tiny_llama, monkeypatch, batch):
    """In a whole decode step of full attention, the queries' positions and the live lengths of the batch are
    computed once a step as rows of one tensor: every layer hands them to the attention kernel as views, with no
    stack a layer (a node of the graph each), and the tokens stay those of each request decoded alone."""
    import tokenselect.attention as attention

    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    prompts = [ids(40 + 7 * b, b) for b in range(batch)]
    alone = [LLM(tiny_llama, "full", cuda_graphs=True, dtype="float32").generate([p], params)[0].token_ids
             for p in prompts]
    stacked = []

    def spy(tensors):
        out = rows(tensors)
        if out.untyped_storage().data_ptr() != tensors[0].untyped_storage().data_ptr():
            stacked.append([tuple(t.shape) for t in tensors])
        return out

    monkeypatch.setattr(attention, "rows", spy)
    llm = LLM(tiny_llama, "full", cuda_graphs=True, dtype="float32")
    steps_before = llm.runner.graphs.whole_steps
    together = [o.token_ids for o in llm.generate(prompts, params)]
    assert llm.runner.graphs.whole_steps - steps_before >= 4  # the decode steps ran as whole steps
    assert stacked == []
    assert together == alone

"""Steps captured whole (``WholeGraphs``): decode steps and a long prompt's full prefill chunks. The
policy plans on the device from a slot table of fixed size, and in decode the Selection Cache's decision
gates the selection work. On a CPU the step function runs eagerly; on a GPU the same tests record and
replay CUDA graphs. Either way it must choose what the eager path chooses and generate its tokens."""

from __future__ import annotations

import pytest
import torch

from tokenselect import LLM, SamplingParams
from tokenselect import whole_graphs
from tokenselect.attention import Chunk
from tokenselect.kernels import get_kernels
from tokenselect.kv_cache import KVCache
from tokenselect.policies import SeqView
from tokenselect.policies.base import GraphSeq
from tokenselect.policies.full import FullAttention
from tokenselect.policies.infllm import InfLLM
from tokenselect.policies.streaming import StreamingLLM
from tokenselect.policies.tokenselect import TokenSelect
from tokenselect.transfer import _ARANGES, arange

from checkpoints import distinct_tokens, small_sizes

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TORCH = get_kernels("torch")


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def graph_context(policy, layer: int, seq: GraphSeq, q: torch.Tensor) -> torch.Tensor:
    """The context of a selective policy's graph list: the list is it, then the step's own tokens (the table's
    next w slots) at the positions after it, every entry attended."""
    own = seq.table[int(seq.length):int(seq.length) + q.shape[0]]
    got = policy.graph_list(layer, seq, q, own)
    n = got.slots.numel() - own.numel()
    assert torch.equal(got.slots[n:], own) and got.n_valid is None
    assert torch.equal(got.key_pos, torch.arange(n + own.numel())) and torch.equal(got.q_pos, got.key_pos[n:])
    return got.slots[:n]


@pytest.mark.parametrize("selector", ["soft_vote", "topk"])  # hard_vote's integer counts tie: any of the tied may go
def test_graph_plan_equals_the_eager_plan(selector):
    """From a table padded with other slots past the sequence's length, graph_list chooses the eager
    plan's list (miss, hit after the window moved, miss); the Selection Cache counts the same."""
    torch.manual_seed(3)
    t0, n_init, n_local, k = 200, 4, 8, 16
    cache = KVCache(1, 600, 2, 16, torch.float32, torch.device("cpu"))
    slots = cache.allocate(t0 + 2)[torch.randperm(t0 + 2)]
    others = cache.allocate(100)
    cache.write(0, torch.cat([slots, others]), torch.randn(t0 + 102, 2, 16), torch.randn(t0 + 102, 2, 16))
    settings = dict(k=k, n_init=n_init, n_local=n_local, theta=0.5, selector=selector)
    eager, graph = TokenSelect(cache, TORCH, **settings), TokenSelect(cache, TORCH, **settings)
    table = torch.cat([slots, others])  # capacity t0 + 102: everything from the length on is not the sequence's
    row = torch.tensor(graph.graph_row(SeqView(5, slots[:t0], decode=True), table.numel(), (1, 4, 16), torch.float32))
    q = torch.randn(1, 4, 16)
    for t, query in ((t0, q), (t0 + 1, q + 0.01 * torch.randn_like(q)), (t0 + 2, -q)):
        assert graph.graph_ready(t)
        want = eager.plan(0, SeqView(5, slots[:t], decode=True), query)
        got = graph_context(graph, 0, GraphSeq(table, torch.tensor(t), row, decode=True), query)
        assert torch.equal(got, want.slots)
        assert torch.equal(want.positions, torch.arange(got.numel()))  # the graph's fixed positions
    assert graph.selection_cache.counts() == eager.selection_cache.counts() == (1, 2)


@pytest.mark.parametrize("selector", ["soft_vote", "topk"])
def test_prefill_chunk_graph_plan_equals_the_eager_plan(selector):
    """A prefill chunk (8 queries) planned on the device from the padded table selects what the eager plan
    selects, with its mean query, and leaves the Selection Cache alone: no lookup, nothing stored."""
    torch.manual_seed(4)
    t0, n_init, n_local, k = 150, 4, 8, 16
    cache = KVCache(1, 400, 2, 16, torch.float32, torch.device("cpu"))
    slots = cache.allocate(300)[torch.randperm(300)]
    cache.write(0, slots, torch.randn(300, 2, 16), torch.randn(300, 2, 16))
    settings = dict(k=k, n_init=n_init, n_local=n_local, theta=0.5, selector=selector)
    eager, graph = TokenSelect(cache, TORCH, **settings), TokenSelect(cache, TORCH, **settings)
    row = torch.tensor(graph.graph_row(SeqView(7, slots[:t0], decode=False), slots.numel(), (8, 4, 16), torch.float32))
    for t in (t0, t0 + 8, t0 + 16):
        q = torch.randn(8, 4, 16)
        want = eager.plan(0, SeqView(7, slots[:t], decode=False), q)
        got = graph_context(graph, 0, GraphSeq(slots, torch.tensor(t), row, decode=False), q)
        assert torch.equal(got, want.slots)
        assert torch.equal(want.positions, torch.arange(got.numel()))
        assert torch.equal(want.q_positions, torch.arange(got.numel(), got.numel() + 8))
    assert graph.selection_cache.counts() == eager.selection_cache.counts() == (0, 0)
    assert not graph.selection_cache.valid.any()


def test_a_grown_arange_keeps_the_one_graphs_read():
    """Plans and graphs take index runs from one arange per device. When a longer one is needed the
    shorter must stay allocated: a recorded CUDA graph reads it by address, and freed memory would be
    handed to the next allocation of its size."""
    dev = torch.device("cpu")
    address = arange(1, dev).data_ptr()
    size = _ARANGES[dev][-1].numel()  # the longest so far (an earlier test may have grown it)
    grown = arange(size + 1, dev)
    assert torch.equal(grown, torch.arange(size + 1)) and grown.data_ptr() != address
    assert address in [kept.data_ptr() for kept in _ARANGES[dev]]  # still allocated: nothing can reuse it


def test_streaming_graph_plan_equals_the_eager_plan():
    cache = KVCache(1, 300, 2, 16, torch.float32, torch.device("cpu"))
    slots = cache.allocate(300)[torch.randperm(300)]
    policy = StreamingLLM(cache, TORCH, n_init=4, n_local=32)
    want = policy.plan(0, SeqView(0, slots[:250], decode=True), torch.randn(1, 4, 16))
    got = graph_context(policy, 0, GraphSeq(slots, torch.tensor(250), torch.tensor(0), decode=True),
                        torch.randn(1, 4, 16))
    assert torch.equal(got, want.slots)


def assert_attends_as(got, want, own: torch.Tensor) -> None:
    """InfLLM's graph list (a GraphList: [own | sinks | blocks | tail], a live prefix) attends what the eager plan
    (``want``) attends with the step's own token: the same slots at the same positions, the own token first."""
    n = int(got.n_valid)
    assert got.slots[0] == own and got.q_pos.tolist() == want.q_positions.tolist()
    assert sorted(zip(got.slots[:n].tolist(), got.key_pos[:n].tolist())) == sorted(
        zip(torch.cat([want.slots, own]).tolist(), torch.cat([want.positions, want.q_positions]).tolist()))


@pytest.mark.parametrize("positions", ["fixed", "reindex", "original"])
def test_infllm_graph_decode_equals_the_eager_plan(positions):
    """After an eager prefill, InfLLM's decode steps planned on the device (two layers, a padded table, blocks
    closing every 4 steps) attend the eager plans' tokens at their positions, the step's own token among them;
    the attention its window receives, counted inside the step, gives the blocks the eager representatives."""
    torch.manual_seed(6)
    layers, t0, steps, n_heads, d = 2, 70, 14, 4, 16
    cache = KVCache(layers, 400, 2, d, torch.float32, torch.device("cpu"))
    slots = cache.allocate(t0 + steps)[torch.randperm(t0 + steps)]
    others = cache.allocate(50)
    table = torch.cat([slots, others])
    for layer in range(layers):
        cache.write(layer, table, torch.randn(table.numel(), 2, d), torch.randn(table.numel(), 2, d))
    settings = dict(window=1000, chunk=10, k=8, n_init=4, n_local=12, block_size=4, repr_keys=2, positions=positions)
    eager, graph = InfLLM(cache, TORCH, **settings), InfLLM(cache, TORCH, **settings)
    for t in range(0, t0, 10):  # the prompt, eagerly on both
        q = torch.randn(10, n_heads, d)
        for policy in (eager, graph):
            for layer in range(layers):
                policy.plan(layer, SeqView(3, slots[:t], decode=False), q)
    for t in range(t0, t0 + steps):
        assert graph.graph_ready(t)
        row = torch.tensor(graph.graph_row(SeqView(3, slots[:t], decode=True), table.numel(), (1, n_heads, d),
                                            torch.float32))
        seq, own = GraphSeq(table, torch.tensor(t), row, decode=True), table[t:t + 1]
        for layer in range(layers):
            q = torch.randn(1, n_heads, d)
            want = eager.plan(layer, SeqView(3, slots[:t], decode=True), q)
            assert_attends_as(graph.graph_list(layer, seq, q, own), want, own)
    for layer in range(layers):  # the eager side counts its last step's attention one call later
        eager.plan(layer, SeqView(3, slots[:t0 + steps], decode=True), torch.randn(1, n_heads, d))
    graph.graph_row(SeqView(3, slots[:t0 + steps], decode=True), table.numel(), (1, n_heads, d), torch.float32)
    for layer in range(layers):
        closed = graph.representatives(3, layer)
        assert closed.shape[0] == (t0 + steps - 4 - 12) // 4 > (t0 - 4 - 12) // 4 + 2  # blocks closed in decode
        torch.testing.assert_close(closed, eager.representatives(3, layer), atol=1e-5, rtol=1e-5)
        # both have counted every query before t0 + steps: the tokens after the closed blocks received the same
        tracked = torch.arange(graph.tracked_from(graph._memory[3].layers[layer]), t0 + steps) % graph.ring
        torch.testing.assert_close(graph.mass[0, layer, tracked], eager.mass[0, layer, tracked])
        assert tracked.numel() >= 12 and (graph.mass[0, layer, tracked].sum(dim=1) > 0).all()


def assert_chunk_attends_as(got, want, own: torch.Tensor) -> None:
    """InfLLM's graph list of a prefill chunk ([sinks | blocks | tail], a live prefix) attends what the eager plan
    (``want``) attends, at the same positions, then the chunk's own tokens, last among the live entries."""
    n, w = int(got.n_valid), own.numel()
    assert torch.equal(got.slots[n - w:n], own) and torch.equal(got.key_pos[n - w:n], got.q_pos)
    assert got.q_pos.tolist() == want.q_positions.tolist()
    assert sorted(zip(got.slots[:n - w].tolist(), got.key_pos[:n - w].tolist())) == sorted(
        zip(want.slots.tolist(), want.positions.tolist()))


@pytest.mark.parametrize("positions", ["fixed", "reindex", "original"])
def test_infllm_graph_prefill_equals_the_eager_plan(positions):
    """Two prompts prefilled in alternation, their chunks past the selection threshold planned on the device: each
    chunk attends the eager plan's tokens at its positions, its own tokens last. A chunk's attention is counted
    from what its graph saved at the sequence's next step, after the other sequence's chunk has overwritten the
    saved queries: the blocks get the eager representatives, the ring the eager scores."""
    torch.manual_seed(9)
    layers, n_heads, d, c, length, capacity = 2, 4, 16, 10, 150, 160
    cache = KVCache(layers, 800, 2, d, torch.float32, torch.device("cpu"))
    settings = dict(window=1000, chunk=c, k=8, n_init=4, n_local=12, block_size=4, repr_keys=2, positions=positions)
    eager, graph = InfLLM(cache, TORCH, **settings), InfLLM(cache, TORCH, **settings)
    prompts = {}
    for seq_id in (4, 7):
        slots = prompts[seq_id] = cache.allocate(length)[torch.randperm(length)]
        for layer in range(layers):
            cache.write(layer, slots, torch.randn(length, 2, d), torch.randn(length, 2, d))
    graph_chunks = 0
    for t in range(0, length, c):
        for seq_id, slots in prompts.items():
            qs, seq = [torch.randn(c, n_heads, d) for _ in range(layers)], SeqView(seq_id, slots[:t], decode=False)
            if not graph.graph_ready(t):
                for policy in (eager, graph):
                    for layer in range(layers):
                        policy.plan(layer, seq, qs[layer])
                continue
            row = graph.graph_row(seq, capacity, (c, n_heads, d), torch.float32)
            table = torch.cat([slots, slots[:1].repeat(capacity - length)])
            on_device = GraphSeq(table, torch.tensor(t), torch.tensor(row), decode=False)
            for layer in range(layers):
                want = eager.plan(layer, seq, qs[layer])
                assert_chunk_attends_as(graph.graph_list(layer, on_device, qs[layer], slots[t:t + c]), want,
                                        slots[t:t + c])
            graph_chunks += 1
    assert graph_chunks == 2 * 12  # from t = 30, past 4 + (2 * 4 + 3) + 12
    for seq_id, slots in prompts.items():  # a decode step counts each prompt's last chunk
        for layer in range(layers):
            q = torch.randn(1, n_heads, d)
            for policy in (eager, graph):
                policy.plan(layer, SeqView(seq_id, slots[:length], decode=True), q)
        for layer in range(layers):
            closed = graph.representatives(seq_id, layer)
            assert closed.shape[0] == (length - 4 - 12) // 4
            torch.testing.assert_close(closed, eager.representatives(seq_id, layer), atol=1e-5, rtol=1e-5)
            mem, row = graph._memory[seq_id].layers[layer], graph._memory[seq_id].row
            tracked = torch.arange(graph.tracked_from(mem), length) % graph.ring
            torch.testing.assert_close(graph.mass[row, layer, tracked], eager.mass[row, layer, tracked])
            assert tracked.numel() >= 12 and (graph.mass[row, layer, tracked].sum(dim=1) > 0).all()


def test_infllm_sequences_share_the_pool_through_graph_and_eager_steps():
    """Sequences come and go while others decode, steps alternate between graphs and the eager path: every step
    attends what the eager policy attends; a new sequence takes the rows and the pool blocks a finished one gave
    back; a decoding sequence holds the blocks it has closed (not the batch's capacity), none shared."""
    torch.manual_seed(8)
    layers, n_heads, d, capacity = 2, 4, 16, 200
    cache = KVCache(layers, 1000, 2, d, torch.float32, torch.device("cpu"))
    settings = dict(window=1000, chunk=10, k=8, n_init=4, n_local=12, block_size=4, repr_keys=2)
    eager, graph = InfLLM(cache, TORCH, **settings), InfLLM(cache, TORCH, **settings)

    def sequence(seq_id: int, prompt: int) -> list:
        slots = cache.allocate(150)[torch.randperm(150)]
        for layer in range(layers):
            cache.write(layer, slots, torch.randn(150, 2, d), torch.randn(150, 2, d))
        for t in range(0, prompt, 10):
            q = torch.randn(10, n_heads, d)
            for policy in (eager, graph):
                for layer in range(layers):
                    policy.plan(layer, SeqView(seq_id, slots[:t], decode=False), q)
        return [seq_id, slots, prompt]

    def step(live: list, as_graph: bool) -> None:
        table = {seq_id: torch.cat([slots, slots[:1].repeat(capacity - 150)]) for seq_id, slots, _ in live}
        seqs = [GraphSeq(table[seq_id], torch.tensor(t), torch.tensor(graph.graph_row(
            SeqView(seq_id, slots[:t], decode=True), capacity, (1, n_heads, d), torch.float32)), decode=True)
            for seq_id, slots, t in live] if as_graph else None
        for layer in range(layers):
            for i, (seq_id, slots, t) in enumerate(live):
                q = torch.randn(1, n_heads, d)
                want = eager.plan(layer, SeqView(seq_id, slots[:t], decode=True), q)
                if as_graph:
                    assert_attends_as(graph.graph_list(layer, seqs[i], q, slots[t:t + 1]), want, slots[t:t + 1])
                else:
                    assert torch.equal(graph.plan(layer, SeqView(seq_id, slots[:t], decode=True), q).slots,
                                       want.slots)
        for entry in live:
            entry[2] += 1

    a = sequence(0, 70)
    for _ in range(6):
        step([a], as_graph=True)
    b = sequence(1, 60)  # a second row
    for i in range(10):
        step([a, b], as_graph=i % 3 > 0)
    a_blocks = list(graph._memory[0].blocks)
    for policy in (eager, graph):
        policy.release(0)
    c = sequence(2, 80)
    assert graph._memory[2].row == 0 and set(graph._memory[2].blocks) <= set(a_blocks)  # what A gave back
    for i in range(30):
        step([c, b], as_graph=i % 4 > 0)
    for seq_id in (1, 2):
        for layer in range(layers):
            torch.testing.assert_close(graph.representatives(seq_id, layer), eager.representatives(seq_id, layer))
    held = sum(len(m.blocks) for m in graph._memory.values())
    assert held == sum((t - 1 - 4 - 12) // 4 for _, _, t in (b, c))  # the blocks closed by each one's last step
    assert len({block for m in graph._memory.values() for block in m.blocks}) == held  # none shared


def test_a_recorded_step_is_judged_by_what_it_changed_in_the_state():
    """The record check compares the replay's change of the policy's state with the eager step's: a ring entry
    the replay put in the wrong place is caught although it is tiny beside the ring's norm; integer state
    must match exactly; rounding passes."""
    before = [torch.rand(64, 32) * 50, torch.tensor([3, 4])]
    eager = [before[0].clone(), before[1] + torch.tensor([0, 1])]
    eager[0][7] += 0.3
    replay = [eager[0] + 1e-7, eager[1].clone()]
    assert whole_graphs._same_change(replay, before, eager)
    wrong = [before[0].clone(), eager[1].clone()]
    wrong[0][8] += 0.3  # the same mass, one entry off
    assert whole_graphs._same(wrong[0], eager[0])  # the whole tensors alone would not tell
    assert not whole_graphs._same_change(wrong, before, eager)
    assert not whole_graphs._same_change([eager[0].clone(), before[1].clone()], before, eager)  # a count missed


@pytest.mark.parametrize("name", ["tokenselect", "tokenselect:theta=None", "streaming", "full", "infllm"])
def test_graph_steps_read_nothing_on_the_host(name):
    """What a graph step runs (``graph_list``, with the PyTorch reference kernels) never reads a device value on the
    host, which a CUDA graph capture refuses: on the meta device, where a tensor has no values, any such read
    raises. (Indexing with a device scalar does read it: InfLLM's first pool layout failed to record on the H100
    that way.) Decode steps and prefill chunks of every graph-ready policy."""
    meta, layers, n_heads, d = torch.device("meta"), 2, 4, 16
    cache = KVCache(layers, 400, 2, d, torch.float32, meta)
    slots = cache.allocate(300)
    sizes = dict(n_init=4, n_local=12)
    policy = {"tokenselect": lambda: TokenSelect(cache, TORCH, k=16, theta=0.5, **sizes),
              "tokenselect:theta=None": lambda: TokenSelect(cache, TORCH, k=16, theta=None, **sizes),
              "streaming": lambda: StreamingLLM(cache, TORCH, **sizes),
              "full": lambda: FullAttention(cache, TORCH),
              "infllm": lambda: InfLLM(cache, TORCH, window=1000, chunk=10, k=8, block_size=4, **sizes)}[name]()
    for t in range(0, 70, 10):  # an eager prompt first (InfLLM's memory, TokenSelect's cache row)
        for layer in range(layers):
            policy.plan(layer, SeqView(0, slots[:t], decode=False), torch.randn(10, n_heads, d, device=meta))
    assert policy.graph_ready(70)
    for w, decode in ((1, True), (8, False)):
        row = policy.graph_row(SeqView(0, slots[:70], decode=decode), slots.numel(), (w, n_heads, d), torch.float32)
        seq = GraphSeq(slots, torch.tensor(70, device=meta), torch.tensor(row, device=meta), decode=decode)
        for layer in range(layers):
            got = policy.graph_list(layer, seq, torch.randn(w, n_heads, d, device=meta), slots[70:70 + w])
            assert got.slots.device == meta and got.q_pos.shape == (w,)


def test_every_layer_of_a_step_shares_one_list_assembled_once():
    """A step's GraphSeq serves all its layers: the sinks, the local window and the step's own slots are put in
    one list by the first layer's graph list (graph nodes once a step, not once a layer), and each layer
    writes only its own choice into that list's middle, which its attention then reads."""
    torch.manual_seed(5)
    cache = KVCache(2, 300, 2, 16, torch.float32, torch.device("cpu"))
    slots = cache.allocate(300)[torch.randperm(300)]
    cache.write(0, slots, torch.randn(300, 2, 16), torch.randn(300, 2, 16))
    cache.write(1, slots, torch.randn(300, 2, 16), torch.randn(300, 2, 16))
    settings = dict(k=16, n_init=4, n_local=32, theta=None)
    graph, eager = TokenSelect(cache, TORCH, **settings), TokenSelect(cache, TORCH, **settings)
    seq = GraphSeq(slots, torch.tensor(250), torch.tensor(0), decode=True)
    q = torch.randn(1, 4, 16)
    frames = []
    for layer in (0, 1):
        got = graph.graph_list(layer, seq, q, slots[250:251])
        want = eager.plan(layer, SeqView(0, slots[:250], decode=True), q)
        assert torch.equal(got.slots, torch.cat([want.slots, slots[250:251]]))
        frames.append(got.slots)
    assert frames[0].data_ptr() == frames[1].data_ptr()  # one list, its middle rewritten by layer 1
    key, = [key for key, value in seq._derived.items() if value is frames[0]]  # kept by the step's GraphSeq
    made = []
    assert seq.once(key, lambda: made.append(1)) is frames[0] and not made

    streaming = StreamingLLM(cache, TORCH, n_init=4, n_local=32)
    seq = GraphSeq(slots, torch.tensor(250), torch.tensor(0), decode=True)
    lists = [streaming.graph_list(layer, seq, torch.randn(1, 4, 16), slots[250:251]) for layer in (0, 1)]
    assert lists[0].slots is lists[1].slots
    assert torch.equal(lists[0].slots, torch.cat([slots[:4], slots[250 - 32:251]]))


@pytest.mark.parametrize("w", [1, 8])  # a decode token, a prefill chunk
def test_full_attention_graph_list_is_the_table_live_up_to_the_steps_own_tokens(w):
    """Full attention's graph list is the whole fixed table; its live prefix (the cached tokens, then the
    step's own) holds the eager plan's slots and the step's, at the plan's positions."""
    cache = KVCache(1, 300, 2, 16, torch.float32, torch.device("cpu"))
    table = cache.allocate(300)[torch.randperm(300)]
    t = 250
    policy = FullAttention(cache, TORCH)
    assert policy.graph_ready(0) and policy.graph_ready(t)
    q = torch.randn(w, 4, 16)
    want = policy.plan(0, SeqView(0, table[:t], decode=w == 1), q)
    got = policy.graph_list(0, GraphSeq(table, torch.tensor(t), torch.tensor(0), decode=w == 1), q, table[t:t + w])
    assert got.slots.numel() == got.key_pos.numel() == 300 and int(got.n_valid) == t + w
    assert torch.equal(got.slots[:t], want.slots) and torch.equal(got.key_pos[:t], want.positions)
    assert torch.equal(got.q_pos, want.q_positions) and torch.equal(got.key_pos[t:t + w], want.q_positions)
    assert torch.equal(got.slots[t:t + w], table[t:t + w])  # the step's own tokens, as the table holds them


def test_which_decode_steps_run_as_whole_graphs(tiny_llama):
    """Decode steps of a graph-ready policy past its selection threshold only; the rest take StepGraphs."""
    llm = LLM(tiny_llama, "full", chunk_size=32, cuda_graphs=True)
    sizes = {"n_init": 4, "n_local": 16}
    for policy, settings, works in (("tokenselect", {"k": 16, "dense_until": 0, **sizes}, True), ("streaming", sizes, True),
                                    ("full", {}, True), ("quest", {}, False),
                                    ("infllm", {"k": 16, "block_size": 4, **sizes}, True)):
        llm.set_attention(policy, **settings)
        seqs = [llm.add_request(ids(80, i), SamplingParams(max_tokens=3, ignore_eos=True)) for i in range(2)]
        while any(s.prefilling for s in seqs):
            llm.step()
        decode = [Chunk(s, i, 1, s.n_cached) for i, s in enumerate(seqs)]
        assert llm.whole_graphs.usable(decode) is works, policy
        assert not llm.whole_graphs.usable([Chunk(seqs[0], 0, 2, seqs[0].n_cached)])  # two tokens
        assert not llm.whole_graphs.usable([Chunk(seqs[0], 0, 1, 20)])  # inside the threshold / a prompt
        for s in seqs:
            llm.abort(s)
    llm.set_attention("tokenselect", positions="original", k=16, n_init=4, n_local=16)
    seq = llm.add_request(ids(80, 9), SamplingParams(max_tokens=3, ignore_eos=True))
    while seq.prefilling:
        llm.step()
    assert not llm.whole_graphs.usable([Chunk(seq, 0, 1, seq.n_cached)])  # positions move with the length
    llm.abort(seq)


def test_which_prefill_chunks_run_as_whole_graphs(tiny_llama, monkeypatch):
    """A prompt of at least PREFILL_MIN_CHUNKS x chunk_size tokens runs its full chunks past the selection
    threshold as whole steps, alone in the step; its first chunks, its last partial chunk, shorter prompts
    and chunks sharing a step with a decode token take StepGraphs."""
    monkeypatch.setattr(whole_graphs, "PREFILL_MIN_CHUNKS", 4)
    llm = LLM(tiny_llama, "tokenselect", chunk_size=32, k=16, n_init=4, n_local=16, dense_until=0,
              cuda_graphs=True)
    graphs = llm.whole_graphs
    seq = llm.add_request(ids(150, 1), SamplingParams(max_tokens=2, ignore_eos=True))
    usable = []
    while seq.prefilling:
        usable.append(graphs.usable([Chunk(seq, 0, min(32, 150 - seq.n_cached), seq.n_cached)]))
        llm.step()
    assert usable == [False, False, True, True, False]  # past 0, 32 (inside 4 + 16 + 16), 64, 96, last 22 rows
    assert graphs.steps_run == 2 and [key[0] for key in graphs._steps] == [False]  # one prefill graph
    short = llm.add_request(ids(127, 2), SamplingParams(max_tokens=2, ignore_eos=True))  # under 4 x 32 tokens
    assert not graphs.usable([Chunk(short, 0, 32, 64)])
    other = llm.add_request(ids(128, 3), SamplingParams(max_tokens=2, ignore_eos=True))
    assert graphs.usable([Chunk(other, 0, 32, 64)])  # alone in its step: yes; beside a decode token: no
    assert not graphs.usable([Chunk(seq, 0, 1, seq.n_cached), Chunk(other, 1, 32, 64)])


@pytest.mark.parametrize("attention,settings", [("tokenselect", {"theta": 0.5}),
                                                ("tokenselect", {"theta": None, "selector": "topk"}),
                                                ("streaming", {}), ("full", {}),
                                                ("infllm", {"k": 16, "block_size": 4, "repr_keys": 2}),
                                                ("infllm", {"k": 16, "block_size": 4, "positions": "original"})])
def test_prefill_through_whole_graphs_gives_the_plain_paths_logits(tiny_llama, batch_invariant_matmuls, monkeypatch,
                                                                   attention, settings):
    """Every prompt position's logits, and then the generated tokens, are the plain path's when the prompt's
    chunks run as whole steps; the Selection Cache then decodes with the same hits and misses."""
    monkeypatch.setattr(whole_graphs, "PREFILL_MIN_CHUNKS", 4)
    sizes = small_sizes(attention)
    engines = [LLM(tiny_llama, attention, chunk_size=32, cuda_graphs=graphs, dtype="float32", **sizes, **settings)
               for graphs in (False, True)]
    prompt = distinct_tokens(200, 6)  # the graph's padded span must not break ties another way
    logits = [llm.prompt_logits(prompt) for llm in engines]
    torch.testing.assert_close(logits[1], logits[0], rtol=1e-4, atol=1e-4)
    # the full chunks past the threshold (4 + 16 + 16 tokens, InfLLM's 4 + (4 * 4 + 3) + 16, streaming's 4 + 16,
    # full attention's 0): from 64 (32, 0), 96, 128, 160; not the last 8 tokens
    assert engines[1].whole_graphs.steps_run == {"tokenselect": 4, "infllm": 4, "streaming": 5, "full": 6}[attention]
    again = distinct_tokens(190, 7)  # another prompt of the same table capacity: the recorded graph again
    torch.testing.assert_close(engines[1].prompt_logits(again), engines[0].prompt_logits(again), rtol=1e-4, atol=1e-4)
    assert len([key for key in engines[1].whole_graphs._steps if not key[0]]) == 1
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
    monkeypatch.setattr(whole_graphs, "PREFILL_MIN_CHUNKS", 4)
    settings = dict(small_sizes("infllm"), k=16, block_size=4, repr_keys=2, positions=positions)
    engines = [LLM(tiny_llama, "infllm", chunk_size=32, cuda_graphs=graphs, dtype="float32", **settings)
               for graphs in (False, True)]
    seqs = []
    for llm in engines:
        seqs.append(llm.add_request(distinct_tokens(200, 11), SamplingParams(max_tokens=3, ignore_eos=True)))
        while seqs[-1].prefilling:
            llm.step()
    assert engines[1].whole_graphs.steps_run == 4  # the chunks from 64 to 160; the last 8 tokens take StepGraphs
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
    monkeypatch.setattr(whole_graphs, "PREFILL_MIN_CHUNKS", 4)
    engines = [LLM(tiny_llama, "full", chunk_size=32, cuda_graphs=graphs, dtype="float32", kernels="triton")
               for graphs in (False, True)]
    prompt = distinct_tokens(150, 8)
    torch.testing.assert_close(engines[1].prompt_logits(prompt), engines[0].prompt_logits(prompt),
                               rtol=1e-4, atol=1e-4)
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    before = engines[1].whole_graphs.steps_run
    outs = [llm.generate([prompt], params)[0].token_ids for llm in engines]
    assert outs[1] == outs[0]
    assert engines[1].whole_graphs.steps_run - before == 4 + 4  # 4 full prefill chunks (of 150), 4 decode steps


def test_tokenselect_through_whole_graphs_with_the_triton_kernels(tiny_llama):
    """Decode graphs with the Triton kernels (the vote, the top-k gated by the Selection Cache's decision, its
    store-or-reuse kernel, the attention) decode the plain path's tokens with the same hits and misses."""
    engines = [LLM(tiny_llama, "tokenselect", chunk_size=32, cuda_graphs=graphs, dtype="float32", kernels="triton",
                   theta=0.0, **small_sizes("tokenselect")) for graphs in (False, True)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompt = distinct_tokens(100, 9)
    outs = [llm.generate([prompt], params)[0].token_ids for llm in engines]
    assert outs[1] == outs[0]
    stats = [llm.stats() for llm in engines]
    assert engines[1].whole_graphs.steps_run >= 9  # every decode step after the first
    for key in ("selection_cache_hits", "selection_cache_misses"):
        assert stats[1][key] == stats[0][key] > 0


@pytest.mark.parametrize("attention,settings", [
    ("tokenselect", {"theta": 0.5}),
    ("tokenselect", {"theta": None, "selector": "topk"}),
    ("tokenselect", {"theta": -1.0}),
    ("tokenselect", {"theta": 0.5, "select_dtype": "fp8"}),
    ("streaming", {}),
    ("full", {}),
    ("infllm", {"k": 16, "block_size": 4, "repr_keys": 2}),
    ("infllm", {"k": 16, "block_size": 4, "repr_keys": 2, "positions": "original"}),
])
def test_engine_generates_the_plain_paths_tokens(tiny_llama, batch_invariant_matmuls, monkeypatch, attention, settings):
    """Requests arriving at different times (so steps alternate between decode graphs and mixed steps
    with a prefill chunk, and the batch size changes) decode what the plain path decodes, with the same
    Selection Cache hits and misses. A small GRAIN makes the tables outgrow their capacity mid-run."""
    monkeypatch.setattr(whole_graphs, "GRAIN", 16)
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
    assert engines[1].whole_graphs.failure is None  # on a GPU: every recorded graph passed its check
    steps = engines[1].whole_graphs._steps
    assert steps and all(capacity % 16 == 0 for _, _, capacity, _ in steps)
    if attention == "tokenselect" and settings["theta"] is not None:
        assert graphed["selection_cache_hits"] == plain["selection_cache_hits"]
        assert graphed["selection_cache_misses"] == plain["selection_cache_misses"]
        assert graphed["selection_cache_misses"] > 0
        assert (graphed["selection_cache_hits"] > 0) is True


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
    honest = TokenSelect.graph_choose

    def graph_choose(self, layer, seq, q, out):
        if torch.cuda.is_current_stream_capturing():
            out.copy_(self.selection_cache.selection[:, layer].index_select(0, seq.row.view(1))[0])
        else:
            honest(self, layer, seq, q, out)

    monkeypatch.setattr(TokenSelect, "graph_choose", graph_choose)
    settings = dict(chunk_size=32, k=16, n_init=4, n_local=16, theta=0.5, dense_until=0, dtype="float32")
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    settings["select_dtype"] = select_dtype
    want = LLM(tiny_llama, "tokenselect", cuda_graphs=False, **settings).generate([ids(70, 1)], params)
    graphed = LLM(tiny_llama, "tokenselect", cuda_graphs=True, kv_offload=kv_offload, **settings)
    with pytest.warns(UserWarning, match="whole-step CUDA graphs turned off"):
        got = graphed.generate([ids(70, 1)], params)
    assert got[0].token_ids == want[0].token_ids
    assert graphed.whole_graphs.failure.startswith("the replay") and not graphed.whole_graphs._steps


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
            assert [key[1] for key in llm.whole_graphs._steps] == [1]  # the longer request alone
    assert outputs[0] == outputs[1]

"""A step's forward pass as CUDA graphs: one cache of graphs, recorded once per key and replayed for every step
of that key. The model runner (``runner.py``) owns it; the dense baseline (``bench/dense.py``) records its
decode graph with the same two calls (``warm_up``, then ``capture``).

With sparse attention at long contexts a step's time is set as much by the host launching a few dozen small
kernels per layer as by the GPU's work. ``GraphCache`` keeps two kinds of graph, by key:

- ``("layers", size)``: the layers around attention, piecewise, for a step of up to ``size`` tokens (decode
  buckets 1, 2, 4, ..., 64 and the prefill chunk), padded rows computing on token 0 and never attended or read.
  Everything between two attention calls works row by row and depends only on the number of rows:
      piece 0:          ids -> x, q, k, v of layer 0         (embedding, layer 0's norm and projections)
      piece i, 0<i<L:   x, out -> x, q, k, v of layer i      (layer i-1's o_proj and MLP, then layer i's)
      piece L:          x, out -> x                          (the last layer's o_proj and MLP)
  where ``out`` is the previous attention's result, copied into a static buffer; attention runs eagerly
  between the pieces (mixed batches and policies whose list changes length run this way).
- ``(phase, batch, capacity, id(policy), mode)``, phase "decode" or "prefill": the whole step, selection and
  sparse attention inside, where a policy's list keeps its length from step to step or is full attention's
  whole table (``AttentionPolicy.graph_ready``: a selective policy while it attends everything, as TokenSelect
  does inside the model's window, and once it selects; every sequence of the step in one mode, each mode a
  graph of its own): its ``attend`` is the code the eager steps run, fed a slot table of fixed
  size (``capacity``: the longest sequence rounded up to GRAIN tokens, so one graph serves up to GRAIN steps
  before a larger one replaces it) with the sequence's length as a device scalar. Decode steps of up to
  MAX_BATCH sequences sharing one policy instance (the Selection Cache's decision gates the selection instead
  of branching: on a hit the vote and the top-k have no live candidate, and the store-or-reuse returns the
  cached choice; torch 2.11 cannot capture conditional nodes), and a prompt's full chunks (``chunk_size``
  tokens) when it has at least PREFILL_MIN_CHUNKS of them: run eagerly, a long prompt's chunks are bound by
  the host's Python. (Not with value offload for full attention: it would stage the table's whole capacity.)

Each whole-step graph is checked when it is recorded (``_WholeStep.record``): if recording fails or the replay
differs from the eager step, a warning says why, the step is answered from the eager run and every later step
goes back to the pieces. The final norm and the vocabulary projection run eagerly on the rows that need logits.
Without CUDA the same step functions run eagerly over the same buffers, which is how the tests exercise them on a
CPU. Every graph is recorded in two calls, ``warm_up(fn)`` then ``capture(fn, pool)``; graphs of one kind share a
memory pool (``GraphPool``).
"""

from __future__ import annotations

import gc
import warnings
import weakref
from typing import Callable

import torch

from .attention import attend_batch, fill_tables
from .models.llama import AttentionContext, CausalLM
from .policies import AttentionPolicy, SeqStep
from .transfer import to_device

DECODE_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # step sizes of the piecewise graphs, besides the prefill chunk
# decode sequences per whole-step graph, as many as the largest decode bucket: each sequence has its own selection
# nodes, so a graph grows with the batch, but past it a step runs layer by layer from the host (at 13 sequences of
# 32K tokens that took 278 ms a step where 8 took 31 ms in one graph, results/supporting/throughput_32k_4306cf1_h200.md)
MAX_BATCH = DECODE_BUCKETS[-1]
GRAIN = 4096  # slot-table capacities are multiples of this
PREFILL_MIN_CHUNKS = 16  # shorter prompts (in chunks) prefill through the pieces: a recording would not pay off


def warm_up(fn: Callable):
    """fn() on a side stream, the current stream waiting for it: what a capture needs to have run once (lazy
    initialisation, cuBLAS workspaces and Triton compiles happen outside the capture). Its result is the eager
    reference a caller may check the replay against."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = fn()
    torch.cuda.current_stream().wait_stream(stream)
    return out


class GraphPool:
    """A graph memory pool, renewed once a graph recorded into it has died: capturing into the pool of dropped
    graphs fails PyTorch 2.11's caching allocator ("use_count > 0 INTERNAL ASSERT FAILED")."""

    def __init__(self):
        self.handle = torch.cuda.graph_pool_handle()
        self._graphs: weakref.WeakSet = weakref.WeakSet()  # the graphs recorded into ``handle``, while alive
        self._recorded = 0

    def take(self, graph: torch.cuda.CUDAGraph):
        """The pool handle to capture ``graph`` into."""
        if len(self._graphs) < self._recorded:
            self.handle = torch.cuda.graph_pool_handle()
            self._graphs, self._recorded = weakref.WeakSet(), 0
        self._graphs.add(graph)
        self._recorded += 1
        return self.handle


def capture(fn: Callable, pool: GraphPool | None) -> tuple[torch.cuda.CUDAGraph, object]:
    """(graph, fn's output tensors as the capture left them: what each replay rewrites). thread_local: another
    thread's CUDA calls (the server's /health reading counters) neither fail nor spoil the capture."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=None if pool is None else pool.take(graph), capture_error_mode="thread_local"):
        out = fn()
    return graph, out


class GraphCache:
    """The graphs of one model runner by key (see the module): ``run_layers(ids, ctx)`` runs a step's layers
    through the pieces; ``whole(chunks)`` says whether a step runs as one graph, ``run_whole(...)`` runs it."""

    def __init__(self, model: CausalLM, cache, kernels, rope, device: torch.device, chunk_size: int):
        """chunk_size: the engine's prefill chunk, a piecewise size of its own and the only chunk length run whole.
        CUDA graphs are recorded on a GPU; elsewhere the same pieces run eagerly."""
        self.model, self.cache, self.kernels, self.rope, self.device = model, cache, kernels, rope, device
        self.chunk_size = chunk_size
        self.sizes = tuple(sorted(set(DECODE_BUCKETS) | ({chunk_size} if chunk_size else set())))
        self.capture = device.type == "cuda"
        # the pieces are never dropped; whole-step graphs are, as tables grow: each kind records into its own pool
        self.layer_pool, self.step_pool = (GraphPool(), GraphPool()) if self.capture else (None, None)
        self.graphs: dict[tuple, _Pieces | _WholeStep] = {}
        self.failure: str | None = None  # why whole-step graphs were turned off, if they were
        self.whole_steps = 0  # steps that ran as one graph each (eagerly, without capture)

    # ---- the layers around attention ----------------------------------------------------------

    def bucket(self, n: int) -> int | None:
        """The size a step of ``n`` tokens runs in through the pieces; None if larger than the largest."""
        return next((size for size in self.sizes if size >= n), None)

    def run_layers(self, ids: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        """ids: [n] -> the last layer's output [n, hidden] (a view of a static buffer, valid until the next
        run of this size). ``ctx.attention(layer, q, k, v)`` gets the n real rows."""
        n = ids.numel()
        size = self.bucket(n)
        if size is None:
            raise ValueError(f"a step of {n} tokens exceeds the largest captured size ({self.sizes[-1]})")
        pieces = self.graphs.get(("layers", size)) or self._record_layers(size)
        pieces.ids[:n].copy_(ids)
        pieces.ids[n:].zero_()
        for i, layer in enumerate(self.model.model.layers):
            _, q, k, v = pieces.play(i)
            pieces.attn_out[:n].copy_(ctx.attention(layer.self_attn.layer, q[:n], k[:n], v[:n]))
        return pieces.play(len(self.model.model.layers))[:n]

    def _record_layers(self, size: int) -> "_Pieces":
        cfg, p = self.model.config, next(self.model.parameters())
        ids = torch.zeros(size, dtype=torch.int64, device=self.device)
        attn_out = torch.zeros(size, cfg.n_heads, cfg.head_dim, dtype=p.dtype, device=self.device)
        layers, embed = self.model.model.layers, self.model.model.embed_tokens

        def first(_):  # each piece up to the last -> (x, q, k, v) of the next layer
            return layers[0].attention_inputs(embed(ids), None)

        def between(i: int) -> Callable:
            def piece(prev):
                return layers[i].attention_inputs(*layers[i - 1].finish(prev[0], attn_out))
            return piece

        def last(prev):
            x, delta = layers[-1].finish(prev[0], attn_out)
            return x + delta

        pieces = _Pieces(ids, attn_out, [first] + [between(i) for i in range(1, len(layers))] + [last])
        if self.capture:
            pieces.capture(self.layer_pool)
        self.graphs[("layers", size)] = pieces
        return pieces

    # ---- whole steps --------------------------------------------------------------------------

    def whole(self, chunks) -> bool:
        """chunks: the step's ``attention.Chunk``s: decode tokens of one policy, or one full prefill chunk."""
        if self.failure is not None or not 0 < len(chunks) <= MAX_BATCH:
            return False
        policy = chunks[0].seq.policy
        if not all(ch.seq.policy is policy and policy.graph_ready(ch.past, ch.length) for ch in chunks):
            return False
        if len({policy.mode(ch.past, ch.length) for ch in chunks}) > 1:
            return False  # a graph is recorded for one mode: a batch whose sequences attend differently is not one
        if len(chunks) == 1 and not chunks[0].decode:
            ch = chunks[0]
            long_prompt = len(ch.seq.prompt_ids) >= PREFILL_MIN_CHUNKS * self.chunk_size
            return ch.length == self.chunk_size and long_prompt
        return all(ch.length == 1 and ch.decode for ch in chunks)

    def run_whole(self, chunks, ids: torch.Tensor, new_slots: torch.Tensor) -> torch.Tensor:
        """Decode tokens (one per chunk) or one prefill chunk: ids [B * w] (on the device; w tokens per
        chunk), new_slots: [B * w] their cache slots -> the last layer's output [B * w, hidden] (a static
        buffer, valid until the next run)."""
        policy: AttentionPolicy = chunks[0].seq.policy
        cfg = self.model.config
        batch, decode = len(chunks), chunks[0].decode
        phase = "decode" if decode else "prefill"
        longest = max(ch.past for ch in chunks) + 1 if decode else len(chunks[0].seq.prompt_ids)
        capacity = -(-longest // GRAIN) * GRAIN
        q_shape, q_dtype = (chunks[0].length, cfg.n_heads, cfg.head_dim), self.model.model.embed_tokens.weight.dtype
        rows = [policy.prepare(ch.seq.id, ch.seq.slots, ch.past, capacity, decode, q_shape, q_dtype) for ch in chunks]
        buffers = [policy.step_buffers(ch.seq.id) for ch in chunks]
        mode = policy.mode(chunks[0].past, chunks[0].length)
        key = (phase, batch, capacity, id(policy), mode)
        step = self.graphs.get(key)
        if step is None or step.state != _pointers(_tensors(policy, buffers)):
            for old in [k for k in self.graphs if k[:2] == (phase, batch) and k[3:] == (id(policy), mode)]:
                del self.graphs[old]  # another capacity: free its memory (the other mode's graph stays in use)
            step = self.graphs[key] = _WholeStep(self, policy, batch, chunks[0].length, capacity, decode, mode,
                                                 buffers)
            step.feed(chunks, ids, rows, new_slots)
            try:
                out = step.record()
            except GraphCheckFailed as failed:
                self.failure = str(failed)
                self.clear()
                warnings.warn(f"whole-step CUDA graphs turned off: {failed}; steps run through the pieces")
                return failed.output
        else:
            step.feed(chunks, ids, rows, new_slots)
            out = step.replay()
        self.whole_steps += 1
        return out

    def whole_keys(self) -> list[tuple]:
        return [key for key in self.graphs if key[0] != "layers"]

    def clear(self) -> None:
        """Drop every whole-step graph (their policies are being replaced; later ones record into a new pool,
        ``GraphPool``). The pieces do not depend on a policy: they stay."""
        for key in self.whole_keys():
            del self.graphs[key]

    def release(self) -> None:
        """Drop every graph, the pieces too, and wait until the GPU has let go of them: a graph that captured an
        NCCL collective holds its communicator, whose teardown (tensor parallel, ``parallel.leave_group``) waits
        until that graph is destroyed. The cache is not used after (``ModelRunner.release``)."""
        self.graphs.clear()
        if self.capture:
            gc.collect()  # graphs in reference cycles
            torch.cuda.synchronize()


class _Pieces:
    """The static buffers and pieces of one size; ``play(i)`` runs piece i and returns its outputs."""

    def __init__(self, ids: torch.Tensor, attn_out: torch.Tensor, pieces: list[Callable]):
        self.ids, self.attn_out, self.pieces = ids, attn_out, pieces
        self.outputs: list = [None] * len(pieces)
        self.graphs: list[torch.cuda.CUDAGraph] | None = None

    def play(self, i: int):
        if self.graphs is None:
            self.outputs[i] = self.pieces[i](self.outputs[i - 1] if i else None)
        else:
            self.graphs[i].replay()
        return self.outputs[i]

    def capture(self, pool: GraphPool) -> None:
        """Run every piece once (``warm_up``), then record each into its own graph; the outputs recorded are
        the static tensors each replay rewrites."""
        warm_up(lambda: [self.play(i) for i in range(len(self.pieces))])
        graphs = []
        for i, piece in enumerate(self.pieces):
            graph, self.outputs[i] = capture(lambda: piece(self.outputs[i - 1] if i else None), pool)
            graphs.append(graph)
        self.graphs = graphs


class GraphCheckFailed(RuntimeError):
    """A whole-step graph could not be recorded, or its replay differed from the eager step. ``output``:
    the step's output from the eager run."""

    def __init__(self, reason: str, output: torch.Tensor):
        super().__init__(reason)
        self.output = output


def _tensors(policy: AttentionPolicy, buffers: list[tuple]) -> tuple[torch.Tensor, ...]:
    """Every tensor a graph of the policy's step reads or writes besides the cache and the step's inputs."""
    return policy.graph_state() + policy.graph_reads() + sum(buffers, ())


def _pointers(tensors: tuple[torch.Tensor, ...]) -> tuple[tuple, ...]:
    """What a graph recorded of the tensors it reads: their addresses and shapes (a tensor of another shape
    at a freed one's address is another tensor)."""
    return tuple((t.data_ptr(), tuple(t.shape)) for t in tensors)


def _restore(tensors, saved) -> None:
    for t, kept in zip(tensors, saved):
        t.copy_(kept)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Integers (slots, flags, counts) exactly; floats to 1% of their norm: the graph runs the eager
    step's kernels, but a library may pick another algorithm under capture, so rounding may differ,
    while a wrong attended list or a skipped selection moves the result far more."""
    if a.is_floating_point():
        return bool((a.float() - b.float()).norm() <= 1e-2 * b.float().norm() + 1e-6)
    return torch.equal(a, b)


def _same_change(state, before, after) -> bool:
    """Whether the tensors ``state`` went from ``before`` to ``after`` (lists of the same tensors' copies), as
    ``_same`` judges: integers exactly, floats by what changed, which may be small beside a float state's norm
    (one step adds to a few entries of InfLLM's ring of every layer and sequence)."""
    # |(t - old) - (new - old)| = |t - new|: one temporary at a time (the ring is large, the KV pool took the rest)
    return all(bool(torch.dist(t, new) <= 1e-2 * torch.dist(new, old) + 1e-6) if t.is_floating_point()
               else _same(t, new) for t, old, new in zip(state, before, after))


class _WholeStep:
    """The static inputs, the step function and (when capturing) the graph of one phase (decode or
    prefill), batch size, width (tokens per sequence) and capacity."""

    def __init__(self, owner: GraphCache, policy: AttentionPolicy, batch: int, width: int, capacity: int,
                 decode: bool, mode: str, buffers: list[tuple]):
        dev = owner.device
        # a proxy: the owner keeps its steps, and a cycle would keep a dropped engine's KV pool until the next gc
        self.owner, self.policy, self.batch, self.width = weakref.proxy(owner), policy, batch, width
        self.decode, self.mode, self.buffers = decode, mode, buffers
        self.ids = torch.zeros(batch * width, dtype=torch.int64, device=dev)
        self.meta = torch.zeros(2, batch, dtype=torch.int64, device=dev)  # lengths, state rows
        self.table = torch.zeros(batch, capacity, dtype=torch.int64, device=dev)
        self.new_slots = torch.zeros(batch * width, dtype=torch.int64, device=dev)
        self.state = _pointers(_tensors(policy, buffers))
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None

    def feed(self, chunks, ids: torch.Tensor, rows: list[int], new_slots: torch.Tensor) -> None:
        self.ids.copy_(ids)
        self.meta.copy_(to_device([[ch.past for ch in chunks], rows], self.meta.device))
        fill_tables(self.table, chunks)
        self.new_slots.copy_(new_slots)

    def replay(self) -> torch.Tensor:
        if self.graph is None:
            self.out = self.forward()
        else:
            self.graph.replay()
        return self.out

    def record(self) -> torch.Tensor:
        """Run the fed step and return its output; with capture, by recording and replaying the graph,
        checked against the same step run eagerly: on a side stream the step runs once (compiling its
        kernels outside the capture, and giving the reference), the policy's state is put back and the
        capture follows (a correct graph's cache writes repeat the eager step's). Raises
        GraphCheckFailed, with the policy's state and the step's cache rows as the eager step left them."""
        if not self.owner.capture:
            return self.replay()
        state = self.policy.graph_state()
        before = [t.clone() for t in state]
        want = warm_up(lambda: self.forward().clone())
        after = [t.clone() for t in state]
        written = self.owner.cache.rows(self.new_slots)  # the step's keys and values, as the eager step wrote them
        _restore(state, before)
        try:
            self.graph, self.out = capture(self.forward, self.owner.step_pool)
            self.graph.replay()
            failure = None if _same(self.out, want) else "the replay's output differs from the eager step's"
            if failure is None and not _same_change(state, before, after):
                failure = "the replay left the policy's state (Selection Cache, InfLLM's ring) unlike the eager step"
        except Exception as err:  # a CUDA error under capture, an op that cannot be captured
            while err.__context__ is not None:  # the capture's end reports only that an op failed before
                err = err.__context__
            failure = f"recording failed ({type(err).__name__}: {err})"
        if failure is not None:
            # back to the eager step's state, its cache rows included: a wrong graph writes other keys
            # and values for the layers after its error (and, with value offload, keeps copies of those values)
            self.graph = None
            _restore(state, after)
            self.owner.cache.put_rows(self.new_slots, written)
            raise GraphCheckFailed(failure, want)
        return self.out

    def forward(self) -> torch.Tensor:
        """The model over the batch's tokens -> the last layer's output [B * w, hidden]."""
        model = self.owner.model.model
        x, delta = model.embed_tokens(self.ids), None
        seqs = [SeqStep(self.table[b], self.meta[0, b], self.meta[1, b], self.decode, self.mode, self.buffers[b])
                for b in range(self.batch)]  # for every layer
        for i, layer in enumerate(model.layers):
            x, q, k, v = layer.attention_inputs(x, delta)
            x, delta = layer.finish(x, self.attention(i, q, k, v, seqs))
        return x + delta

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  seqs: list[SeqStep]) -> torch.Tensor:
        """q: [B * w, n_heads, d], k, v: [B * w, n_kv_heads, d] un-rotated -> [B * w, n_heads, d]: each
        sequence's w tokens attend what its policy chooses, their own tokens causally; a batch in one attention
        launch (``attention.attend_batch``)."""
        owner, cache, w = self.owner, self.owner.cache, self.width
        cache.write(layer, self.new_slots, k, v)
        batched = q.view(self.batch, w, *q.shape[1:])
        return attend_batch(self.policy, cache, owner.kernels, owner.rope, layer, seqs, batched,
                            self.new_slots.view(self.batch, w)).view(q.shape)

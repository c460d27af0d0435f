"""Engine steps captured whole as CUDA graphs: selection and sparse attention inside.

``StepGraphs`` leaves attention out of its graphs. Once a policy's list keeps its length from step to step
(``AttentionPolicy.graph_ready``: full attention from the first token, the selective policies once they
select) nothing has to leave the GPU: the policy's ``attend`` is the same code the eager steps run, fed a
slot table of fixed size with the sequence's length as a device scalar. (Not with value offload for full
attention: it would stage the table's whole capacity.) Two kinds of step run here, each as one graph launch
with no host read per layer:

- decode steps: one token for each of up to MAX_BATCH sequences sharing one policy instance. The
  Selection Cache's decision gates the selection instead of branching: on a hit the vote and the
  top-k have no live candidate (their kernels read no score or key, and return at once but for the
  top-k's last, which writes placeholder picks), and the store-or-reuse returns the cached choice.
  (CUDA graph conditional nodes would skip even the launches; torch 2.11, what the GPU runs, cannot
  capture them.)
- prefill chunks: a step that is one sequence's full chunk (``chunk_size`` tokens) of a prompt of at
  least PREFILL_MIN_CHUNKS x ``chunk_size`` tokens. Run eagerly, a long prompt's chunks are bound by the
  host's Python, not by the GPU. (InfLLM's host work between chunks, closing blocks and counting the last
  chunk's attention, is queued by its ``prepare`` while the GPU still runs the previous chunk.)

A graph is recorded per (kind, batch size, table capacity, policy, mode). A decode graph's capacity is the
longest sequence's length rounded up to GRAIN tokens, so one graph serves up to GRAIN steps before a
larger one replaces it; a prefill graph's is the prompt's length rounded up likewise, so one graph serves
the whole prompt. Every other step (mixed batches, partial chunks, dynamic NTK, a sequence not yet past
the selection threshold) runs through ``StepGraphs``. Without CUDA (or with ``capture=False``) the same
step function runs eagerly: that is how the tests exercise what the graphs run on a CPU.

Each graph checks itself when recorded: the step it records is also run eagerly, and the replay must
reproduce that step's output and the policy's state (the Selection Cache's entries and counts). If
recording fails or the two differ, a warning says why and every step goes back to ``StepGraphs`` for the
rest of the engine's life; the step is answered from the eager run, its cache rows restored.
"""

from __future__ import annotations

import warnings
import weakref

import torch

from .attention import attend
from .cuda_graphs import GraphPool, capture, warm_up
from .policies import AttentionPolicy, SeqStep
from .transfer import to_device

MAX_BATCH = 8  # decode sequences per graph step (each has its own selection nodes)
GRAIN = 4096  # slot-table capacities are multiples of this
PREFILL_MIN_CHUNKS = 16  # shorter prompts (in chunks) prefill through StepGraphs: a recording would not pay off


class WholeGraphs:
    """``usable(chunks)`` says whether a step can run here; ``run(...)`` runs it."""

    def __init__(self, model, cache, kernels, rope, device: torch.device, chunk_size: int,
                 capture: bool | None = None):
        """chunk_size: the engine's prefill chunk, the only chunk length run here."""
        self.model, self.cache, self.kernels, self.rope, self.device = model, cache, kernels, rope, device
        self.chunk_size = chunk_size
        self.capture = device.type == "cuda" if capture is None else capture
        self.pool = GraphPool() if self.capture else None
        self._steps: dict[tuple[bool, int, int, int], _GraphStep] = {}  # (decode, batch, capacity, id(policy))
        self.failure: str | None = None  # why whole-step graphs were turned off, if they were
        self.steps_run = 0  # steps that ran here (as one graph each, when capturing)

    def usable(self, chunks) -> bool:
        """chunks: the step's ``attention.Chunk``s: decode tokens of one policy, or one full prefill chunk."""
        if self.failure is not None or not 0 < len(chunks) <= MAX_BATCH:
            return False
        if self.rope.spec.kind == "dynamic":
            return False
        policy = chunks[0].seq.policy
        if not all(ch.seq.policy is policy and policy.graph_ready(ch.past, ch.length) for ch in chunks):
            return False
        if len(chunks) == 1 and not chunks[0].decode:
            ch = chunks[0]
            long_prompt = len(ch.seq.prompt_ids) >= PREFILL_MIN_CHUNKS * self.chunk_size
            return ch.length == self.chunk_size and long_prompt
        return all(ch.length == 1 and ch.decode for ch in chunks)

    def run(self, chunks, ids: list[int], new_slots: torch.Tensor) -> torch.Tensor:
        """Decode tokens (one per chunk) or one prefill chunk: ids [B * w] (host list; w tokens per
        chunk), new_slots: [B * w] their cache slots -> the last layer's output [B * w, hidden] (a static
        buffer, valid until the next run)."""
        policy: AttentionPolicy = chunks[0].seq.policy
        cfg = self.model.config
        batch, decode = len(chunks), chunks[0].decode
        longest = max(ch.past for ch in chunks) + 1 if decode else len(chunks[0].seq.prompt_ids)
        capacity = -(-longest // GRAIN) * GRAIN
        q_shape, q_dtype = (chunks[0].length, cfg.n_heads, cfg.head_dim), self.model.model.embed_tokens.weight.dtype
        rows = [policy.prepare(ch.seq.id, ch.seq.slots, ch.past, capacity, decode, q_shape, q_dtype) for ch in chunks]
        buffers = [policy.step_buffers(ch.seq.id) for ch in chunks]
        mode = policy.mode(chunks[0].past, chunks[0].length)
        key = (decode, batch, capacity, id(policy), mode)
        step = self._steps.get(key)
        if step is None or step.state != _pointers(_tensors(policy, buffers)):
            for old in [k for k in self._steps if (k[0], k[1], k[3]) == (decode, batch, id(policy))]:
                del self._steps[old]  # another capacity: free its memory
            step = self._steps[key] = _GraphStep(self, policy, batch, chunks[0].length, capacity, decode, mode,
                                                 buffers)
            step.feed(chunks, ids, rows, new_slots)
            try:
                out = step.record()
            except GraphCheckFailed as failed:
                self.failure = str(failed)
                self._steps.clear()
                warnings.warn(f"whole-step CUDA graphs turned off: {failed}; steps run through StepGraphs")
                return failed.output
        else:
            step.feed(chunks, ids, rows, new_slots)
            out = step.replay()
        self.steps_run += 1
        return out

    def clear(self) -> None:
        """Drop every recorded graph (their policies are being replaced; later graphs record into a new pool,
        ``GraphPool``)."""
        self._steps.clear()


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


class _GraphStep:
    """The static inputs, the step function and (when capturing) the graph of one kind (decode or
    prefill), batch size, width (tokens per sequence) and capacity."""

    def __init__(self, owner: WholeGraphs, policy: AttentionPolicy, batch: int, width: int, capacity: int,
                 decode: bool, mode: str, buffers: list[tuple]):
        dev = owner.device
        # a proxy: the owner keeps its steps, and a cycle would keep a dropped engine's KV pool until the next gc
        self.owner, self.policy, self.batch, self.width = weakref.proxy(owner), policy, batch, width
        self.decode, self.mode, self.buffers = decode, mode, buffers
        self.inputs = torch.zeros((width + 2) * batch, dtype=torch.int64, device=dev)  # filled by one copy
        self.ids = self.inputs[:batch * width]
        self.meta = self.inputs[batch * width:].view(2, batch)  # lengths, state rows
        self.table = torch.zeros(batch, capacity, dtype=torch.int64, device=dev)
        self.new_slots = torch.zeros(batch * width, dtype=torch.int64, device=dev)
        self.state = _pointers(_tensors(policy, buffers))
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None

    def feed(self, chunks, ids: list[int], rows: list[int], new_slots: torch.Tensor) -> None:
        self.inputs.copy_(to_device(ids + [ch.past for ch in chunks] + rows, self.inputs.device))
        for b, ch in enumerate(chunks):  # the cached tokens' slots and the step's own
            self.table[b, :ch.past + ch.length].copy_(ch.seq.slots[:ch.past + ch.length])
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
        cache = self.owner.cache  # the step's keys and values, as the eager step wrote them
        pools = [pool.view(torch.uint8) for pool in cache.pools]  # (the V pool may be on the host)
        written = [pool[:, self.new_slots.to(pool.device)].clone() for pool in pools]
        _restore(state, before)
        try:
            self.graph, self.out = capture(self.forward, self.owner.pool)
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
            # and values for the layers after its error
            self.graph = None
            _restore(state, after)
            for pool, kept in zip(pools, written):
                pool[:, self.new_slots.to(pool.device)] = kept
            raise GraphCheckFailed(failure, want)
        return self.out

    def forward(self) -> torch.Tensor:
        """The model over the batch's tokens -> the last layer's output [B * w, hidden]."""
        model = self.owner.model.model
        x = model.embed_tokens(self.ids)
        seqs = [SeqStep(self.table[b], self.meta[0, b], self.meta[1, b], self.decode, self.mode, self.buffers[b])
                for b in range(self.batch)]  # for every layer
        for i, layer in enumerate(model.layers):
            q, k, v = layer.attention_inputs(x)
            x = layer.finish(x, self.attention(i, q, k, v, seqs))
        return x

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  seqs: list[SeqStep]) -> torch.Tensor:
        """q: [B * w, n_heads, d], k, v: [B * w, n_kv_heads, d] un-rotated -> [B * w, n_heads, d]: each
        sequence's w tokens attend what its policy chooses (``attention.attend``), their own tokens causally."""
        owner, cache, w = self.owner, self.owner.cache, self.width
        cache.write(layer, self.new_slots, k, v)
        outs = [attend(self.policy, cache, owner.kernels, owner.rope, layer, seq, q[b * w:(b + 1) * w],
                       self.new_slots[b * w:(b + 1) * w]) for b, seq in enumerate(seqs)]
        return outs[0] if len(outs) == 1 else torch.cat(outs)

"""InfLLM: a block-level context memory searched through representative keys (Xiao et al., 2024,
"InfLLM: Training-Free Long-Context Extrapolation for LLMs with an Efficient Context Memory").

The middle of the cache is cut into blocks of ``block_size`` tokens, aligned to its start. Once a
block has left the local window for good it gets one representative key per query head: the mean of
its ``repr_keys`` keys that received the most attention while they were inside the local window
(InfLLM's ``get_block_k``). A chunk scores block b by sum_h <q_h, repr[b, h]> with its mean
un-rotated query and attends the ``k // block_size`` best blocks, the middle tokens that do not fill a
block yet (InfLLM's "global remainder", always attended), the ``n_init`` initial tokens and the
``n_local`` most recent ones.

Attention received inside the local window: for a query at i and a key at j with 0 <= i - j < n_local,
the key's share of that query's softmax (over everything the query attended), summed over queries,
per query head. The engine does not hand attention weights back, so each chunk's un-rotated queries
are kept until the next call for the same sequence and layer; by then the chunk's own keys are in
``seq.past`` and its weights are recomputed from un-rotated dot products.

Positions: ``"fixed"`` (default, InfLLM's scheme) puts the whole memory (initial tokens, blocks,
remainder) at one position, n_local before the chunk's first query, and the local window at its
true distances. While the budget still covers the whole context and it fits the model ``window`` at
its own positions, the plan is plain full attention; past the window the fixed scheme applies to it
too. ``"reindex"`` and ``"original"`` as for the other policies.

The memory lives on the device, so that a step runs the same eagerly and as one CUDA graph: the
representatives in a pool of blocks shared by all sequences (``reprs``; a sequence's closed blocks are rows of
it, listed in its row of ``table``, as the KV pool's slots are listed in a slot table), and, a row per sequence,
the attention received by the tokens not yet in a closed block (``mass``, a ring indexed by token index). The
blocks that leave the window are given their representatives on the host before a step (``prepare``): one block
every ``block_size`` decode steps, a chunk's worth before a chunk. A decode step counts its own query's
attention on the device. A prefill chunk leaves its queries and each layer's list in the sequence's ``saved``
buffers, and its attention is counted from them on the host, at the sequence's next step.

Prefix reuse (``prefix_cache.py``): a reused prefix has its keys and values but never ran its queries, so the
memory they built comes with it: ``snapshot`` takes a sequence's memory at a chunk boundary (its last chunk's
attention counted, the blocks that a step there closes closed): the pool blocks of its closed blocks, shared
(counted in ``refs``, never copied: a closed block's representatives do not change), and the local scores of the
tokens after them (a copy). ``restore`` gives a new sequence that memory, as if it had computed the prefix itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels import Kernels
from ..kv_cache import KVCache
from ..transfer import to_device
from ..settings import Validated, setting
from .base import (ALL, SELECT, Attended, SelectivePolicy, SeqStep, dense_until_setting, n_init_setting,
                   n_local_setting, positions_setting)
from .rows import Rows, grown

POOL_GROWTH = 1.25  # the pool of representatives grows by at least this factor (and to at least 256 blocks)
SPARE_SHAPES = 4  # saved buffers kept for later prompts, of this many shapes at most
FIXED = "all, fixed"  # every token, with InfLLM's fixed positions (the window past the model's)


@dataclass
class Memory:
    """One sequence's memory in one layer, and what the host knows of it.

    ring: [ring, H] the local scores (a view of ``InfLLM.mass[row, layer]``); tracked: tokens up to here have an
        entry (zeroed when the token came).
    closed: how many of the sequence's blocks have a representative in this layer.
    pending: the last chunk's queries [c, H, d], the context slots it attended [n] and its first token index,
        until their attention weights are counted.
    """

    ring: torch.Tensor
    closed: int
    tracked: int
    pending: tuple[torch.Tensor, torch.Tensor, int] | None = None


@dataclass
class SequenceMemory:
    """row: the sequence's row of ``InfLLM.mass`` and ``InfLLM.table``; blocks: the pool blocks holding its
    closed blocks' representatives, in order (``table[row, :len(blocks)]`` on the device); layers: per layer;
    saved: a prefill chunk's queries [layers, w, H, d] and lists [layers, n], written by the step, until counted."""

    row: int
    blocks: list[int]
    layers: list[Memory]
    saved: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(frozen=True)
class InfLLMSettings(Validated):
    k: int = setting(4096, "tokens of memory blocks attended", unit="tokens", low=0, scales=True, per_request=True)
    n_init: int = n_init_setting(128)
    # >= 1: the representatives come from the attention tokens receive inside the local window
    n_local: int = n_local_setting(4096, low=1)
    block_size: int = setting(128, "tokens per memory block", unit="tokens", low=1, scales=True)
    repr_keys: int = setting(4, "representative keys per block", low=1)
    positions: str = positions_setting("fixed", ("fixed", "reindex", "original"))
    dense_until: int | None = dense_until_setting()


@dataclass(eq=False)
class InfLLMState:
    """A sequence's memory after its first ``t`` tokens (``InfLLM.snapshot``): ``closed`` blocks per layer, held in
    the pool blocks ``blocks`` of ``owner`` (one reference each), and the local scores of tokens
    n_init + closed * block_size .. t-1, ``ring`` [layers, tokens, H] fp32. For Llama-3-8B (32 layers, 32 heads of
    128) at the defaults: the scores of at most n_local + block_size = 4224 tokens once InfLLM selects, 4 KiB each
    (16.5 MiB), and the shared representatives, 512 KiB per 128-token block (4 KiB per token; the bf16 KV is 128)."""

    owner: "InfLLM"
    t: int
    closed: int
    blocks: tuple[int, ...]
    ring: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        """The device memory the state holds: its scores, and its blocks' representatives (shared with the other
        states and sequences that hold them: counted in full by each)."""
        ring = self.ring.nbytes if self.ring is not None else 0
        return ring + len(self.blocks) * self.owner.reprs[:, :1].nbytes

    def release(self) -> None:
        """Drop the state (its block references go back to the owner). Once only."""
        if self.ring is not None:
            self.owner._unref(self.blocks)
            self.ring = None


class InfLLM(SelectivePolicy):
    name = "infllm"
    prefix_state = True  # a reused prefix needs the memory its queries built: ``snapshot`` / ``restore``
    POSITIONS = ("fixed", "reindex", "original")
    Settings = InfLLMSettings

    def __init__(self, cache: KVCache, kernels: Kernels, window: int, chunk: int = 512, **settings):
        """window: the model's; chunk: the engine's prefill chunk (the local-score ring is sized for it)."""
        s = self.Settings(**settings)
        block_size, n_local = s.block_size, s.n_local
        self.n_blocks = s.k // block_size
        # at most n_blocks blocks + a remainder shorter than a block
        super().__init__(cache, kernels, n_init=s.n_init, n_local=n_local,
                         budget=self.n_blocks * block_size + block_size - 1, positions=s.positions,
                         dense_until=s.dense_until)
        self.k, self.block_size, self.repr_keys = s.k, block_size, min(s.repr_keys, block_size)
        self.window = window
        self.n_layers = cache.k.shape[0]
        # the ring holds every token not yet in a closed block: before the first selection the whole context past
        # the sinks (at most budget + n_local, or dense_until, then a chunk), later the window, a block and the chunks
        # around it
        self.ring = max(self.budget + n_local, self.dense_until - s.n_init) + 2 * (chunk + block_size)
        self.reprs: torch.Tensor | None = None  # [layers, pool blocks, H, d] fp32: the representatives
        self.free: list[int] = []  # pool blocks no sequence holds
        self.refs: dict[int, int] = {}  # pool block -> its holders (a sequence, a prefix snapshot), for held ones
        self.table: torch.Tensor | None = None  # [rows, blocks] int64: each sequence's pool blocks, in order
        self.mass: torch.Tensor | None = None  # [rows, layers, ring, H] fp32: the local scores
        self.rows = Rows()
        self._memory: dict[int, SequenceMemory] = {}  # sequence id -> its memory
        # saved buffers no sequence holds, by shape, for the next prompt (a prefill graph recorded with them replays
        # for it); a few shapes at most: a prompt's full chunks and its last, partial one
        self._spare: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def mode(self, t: int, w: int) -> str:
        """SELECT past the budget and ``dense_until``; before them every token, at InfLLM's fixed positions once the
        step reaches past the model's window (with the "fixed" scheme)."""
        if t > self.n_init + self.budget + self.n_local and t + w > self.dense_until:
            return SELECT
        return FIXED if self.positions == "fixed" and t + w > self.window and t > self.n_local else ALL

    # ---- device state ---------------------------------------------------------------------------

    def memory(self, seq_id: int, n_heads: int, device: torch.device) -> SequenceMemory:
        """The memory of sequence ``seq_id``, with a row of device state (taken on first use)."""
        if seq_id not in self._memory:
            row = self.rows.take(seq_id)
            self._reserve_rows(row + 1, n_heads, device)
            self._memory[seq_id] = SequenceMemory(row, [], [Memory(self.mass[row, layer], 0, self.n_init)
                                                            for layer in range(self.n_layers)])
        return self._memory[seq_id]

    def _reserve_rows(self, rows: int, n_heads: int, device: torch.device) -> None:
        """At least ``rows`` rows of the per-sequence state (the ring and the block table), keeping what they hold
        (the memories' views move to the grown tensors)."""
        if self.mass is None:
            self.mass = torch.zeros(0, self.n_layers, self.ring, n_heads, device=device)
            self.table = torch.zeros(0, 0, dtype=torch.int64, device=device)
            self.reprs = torch.zeros(self.n_layers, 0, n_heads, self.cache.k.shape[-1], device=device)
        have = self.mass.shape[0]
        if rows <= have:
            return
        self.mass, self.table = grown(self.mass, 0, max(rows, 2 * have)), grown(self.table, 0, max(rows, 2 * have))
        for seq in self._memory.values():
            for layer, mem in enumerate(seq.layers):
                mem.ring = self.mass[seq.row, layer]

    def _reserve_table(self, n: int) -> None:
        """Room for ``n`` blocks in every row of the block table."""
        if self.table.shape[1] < n:
            self.table = grown(self.table, 1, max(n, 2 * self.table.shape[1]))

    def _reserve_blocks(self, seq: SequenceMemory, n: int) -> None:
        """Give the sequence pool blocks for its first ``n`` blocks."""
        new = n - len(seq.blocks)
        if new <= 0:
            return
        if len(self.free) < new:  # grow the pool, keeping what it holds
            have = self.reprs.shape[1]
            size = max(have + new - len(self.free), int(have * POOL_GROWTH), 256)
            self.reprs = grown(self.reprs, 1, size)
            self.free.extend(range(size - 1, have - 1, -1))
        self._hold(seq, [self.free.pop() for _ in range(new)])

    def _hold(self, seq: SequenceMemory, blocks: list[int]) -> None:
        """Append pool ``blocks`` (one holder more each) to the sequence's, in its row of the block table too."""
        self.refs.update({block: self.refs.get(block, 0) + 1 for block in blocks})
        have, n = len(seq.blocks), len(seq.blocks) + len(blocks)
        self._reserve_table(n)
        self.table[seq.row, have:n] = to_device(blocks, self.table.device)
        seq.blocks.extend(blocks)

    def ring_spans(self, start: int, stop: int) -> list[tuple[slice, slice]]:
        """Tokens start..stop-1 in the ring: (ring entries, the same tokens' offsets from start) pieces, at
        most two (where the ring wraps). Slices, not index tensors: no index kernel is launched."""
        spans, t = [], start
        while t < stop:
            entry = t % self.ring
            n = min(stop - t, self.ring - entry)
            spans.append((slice(entry, entry + n), slice(t - start, t - start + n)))
            t += n
        return spans

    def track(self, mem: Memory, upto: int) -> None:
        """Give the tokens from ``mem.tracked`` to ``upto`` - 1 their (zeroed) ring entries."""
        if upto <= mem.tracked:
            return
        if upto - self.tracked_from(mem) > self.ring:
            raise RuntimeError(f"InfLLM's local-score ring of {self.ring} tokens cannot hold tokens "
                               f"{self.tracked_from(mem)}..{upto - 1}: a prefill chunk larger than the policy's "
                               f"chunk setting?")
        for entries, _ in self.ring_spans(mem.tracked, upto):
            mem.ring[entries].zero_()
        mem.tracked = upto

    def tracked_from(self, mem: Memory) -> int:
        """Token index of the oldest token with a ring entry (the first not in a closed block)."""
        return self.n_init + mem.closed * self.block_size

    # ---- on the host, before a step -------------------------------------------------------------

    def prepare(self, seq_id: int, slots: torch.Tensor, t: int, capacity: int, decode: bool,
                q_shape: tuple[int, int, int], q_dtype: torch.dtype) -> int:
        """Bring the sequence's memory up to the step about to run: count its last chunk's attention, give the
        blocks that have left the window their representatives (once it selects), and make room in the block
        table for ``capacity`` tokens. A decode step starts its own token's ring entry itself. Before a prefill
        chunk the sequence gets pool blocks for every block its table will close, so that the pool does not grow
        under a graph, and buffers for the chunk's queries and lists; its attention is left pending, to be counted
        from them."""
        w, n_heads, _ = q_shape
        memory = self.memory(seq_id, n_heads, slots.device)
        mode = self.mode(t, w)
        self.catch_up(memory, slots, t, mode == SELECT)
        self._reserve_table(capacity // self.block_size)
        if decode:
            for mem in memory.layers:
                mem.tracked = t + 1
            self._give_back(memory)
            return memory.row
        # from the first chunk on (inside the threshold too), so that neither the pool nor the block table grows under
        # the prompt's graphs
        self._reserve_blocks(memory, self.closed_before(capacity))
        # a selecting chunk's list; before the threshold and inside dense_until, the whole table's live part fits
        n = max(self.list_length(w), self.dense_until)
        shape = (tuple(q_shape), q_dtype, n)
        if memory.saved is None or _shape(memory.saved) != shape:
            self._give_back(memory)
            memory.saved = self._spare.pop(shape, None) or (
                torch.zeros(self.n_layers, *q_shape, dtype=q_dtype, device=slots.device),
                torch.zeros(self.n_layers, n, dtype=torch.int64, device=slots.device))
        saved = memory.saved
        # the list's live part before the chunk's own tokens: sinks, blocks, remainder, window; or the whole context
        context = self.n_blocks * self.block_size + t - self.closed_before(t) * self.block_size if mode == SELECT else t
        for layer, mem in enumerate(memory.layers):
            mem.pending = (saved[0][layer], saved[1][layer, :context], t)
        return memory.row

    def catch_up(self, memory: SequenceMemory, slots: torch.Tensor, t: int, select: bool) -> None:
        """Bring each layer's memory up to ``t`` cached tokens (slots: the sequence's table): its pending chunk's
        attention counted, tokens up to t tracked, and (``select``) the blocks a step after t finds closed closed."""
        for layer, mem in enumerate(memory.layers):
            if mem.pending is not None:
                self.count_attention(layer, slots, mem)
            self.track(mem, t)
            if select:
                self.close_blocks(layer, memory, slots, mem, self.closed_before(t))

    def step_buffers(self, seq_id: int) -> tuple[torch.Tensor, ...]:
        """A prefill chunk's buffers for its queries and lists (``SequenceMemory.saved``)."""
        return self._memory[seq_id].saved or ()

    def count_attention(self, layer: int, slots: torch.Tensor, mem: Memory) -> None:
        """Add the pending chunk's local-window attention weights to the ring (slots: the sequence's table)."""
        q, context, t0 = mem.pending
        mem.pending = None
        c = q.shape[0]
        t = t0 + c  # the chunk's keys are slots[t0:t] now
        self.track(mem, t)
        lo = max(self.tracked_from(mem), t0 - self.n_local + 1)  # oldest tracked key inside some query's window
        if lo >= t:
            return
        # the list's context ends with the local window, so tokens lo..t-1 are the last columns
        attended = torch.cat([context, slots[t0:t]])
        scale = 1.0 / math.sqrt(q.shape[-1])
        mass = self.kernels.window_mass(q, self.cache.k[layer], attended, c, t0, lo, self.n_local, scale)
        for entries, part in self.ring_spans(lo, t):
            mem.ring[entries].add_(mass[part])

    def close_blocks(self, layer: int, memory: SequenceMemory, slots: torch.Tensor, mem: Memory, n_full: int) -> None:
        """Give representatives to the blocks mem.closed..n_full-1 of the middle, in this layer."""
        new, bs = n_full - mem.closed, self.block_size
        if new <= 0:
            return
        self._reserve_blocks(memory, n_full)
        n_heads, d = self.reprs.shape[2:]
        start = self.tracked_from(mem)
        keys = self.cache.k[layer][slots[start:start + new * bs]].float()  # [new * bs, n_kv, d]
        keys = keys.repeat_interleave(n_heads // keys.shape[1], dim=1).view(new, bs, n_heads, d)
        parts = [mem.ring[entries] for entries, _ in self.ring_spans(start, start + new * bs)]
        scores = parts[0] if len(parts) == 1 else torch.cat(parts)
        top = scores.view(new, bs, n_heads).topk(self.repr_keys, dim=1).indices  # [new, r, H]
        chosen = keys.gather(1, top[..., None].expand(-1, -1, -1, d))  # [new, r, H, d]
        self.reprs[layer].index_copy_(0, self.table[memory.row, mem.closed:n_full], chosen.mean(dim=1))
        mem.closed = n_full

    def representatives(self, seq_id: int, layer: int) -> torch.Tensor:
        """The representatives of a sequence's closed blocks in one layer: [blocks, H, d] fp32."""
        memory = self._memory[seq_id]
        return self.reprs[layer, memory.blocks[:memory.layers[layer].closed]]

    def _give_back(self, memory: SequenceMemory) -> None:
        """Drop the sequence's saved buffers (their chunk counted, or not needed any more): they become the spare set
        (one shape for every chunk of w tokens, the shape a prefill graph writes)."""
        saved, memory.saved = memory.saved, None
        if saved is not None:
            self._spare[_shape(saved)] = saved
            while len(self._spare) > SPARE_SHAPES:
                del self._spare[next(iter(self._spare))]

    def release(self, seq_id: int) -> None:
        memory = self._memory.pop(seq_id, None)
        self.rows.release(seq_id)
        if memory is not None:
            self._unref(memory.blocks)
            self._give_back(memory)

    def _unref(self, blocks) -> None:
        """One holder less for each of ``blocks``: those no one holds go back to the free list."""
        for block in reversed(blocks):
            self.refs[block] -= 1
            if not self.refs[block]:
                del self.refs[block]
                self.free.append(block)

    # ---- prefix reuse ------------------------------------------------------------------------------

    def snapshot(self, seq_id: int, slots: torch.Tensor, t: int) -> InfLLMState:
        """The memory of sequence ``seq_id`` (slots: its table) after its first ``t`` tokens, the last step's (a
        prefill chunk ending at t): the chunk's attention is counted and the blocks a step after t closes are closed
        now, as the sequence's next ``prepare`` would (it then finds nothing left to do)."""
        memory = self._memory[seq_id]
        self.catch_up(memory, slots, t, self.mode(t, 1) == SELECT)
        closed = memory.layers[0].closed
        spans = self.ring_spans(self.tracked_from(memory.layers[0]), t)
        ring = torch.cat([self.mass[memory.row, :, entries] for entries, _ in spans], dim=1) if spans else \
            self.mass.new_zeros(self.n_layers, 0, self.mass.shape[-1])
        blocks = tuple(memory.blocks[:closed])
        self.refs.update({block: self.refs[block] + 1 for block in blocks})
        return InfLLMState(self, t, closed, blocks, ring)  # (torch.cat copies)

    def restore(self, seq_id: int, state: InfLLMState) -> None:
        """Give sequence ``seq_id``, which has computed nothing of its own, the memory ``state`` (of this instance)
        holds, as its memory after the first ``state.t`` tokens."""
        assert state.owner is self and state.ring is not None, "a prefix snapshot of another InfLLM instance"
        self.release(seq_id)
        n_layers, _, n_heads = state.ring.shape
        memory = self.memory(seq_id, n_heads, state.ring.device)
        self._hold(memory, list(state.blocks))
        for mem in memory.layers:
            mem.closed, mem.tracked = state.closed, max(state.t, self.n_init)
        for entries, part in self.ring_spans(self.tracked_from(memory.layers[0]), state.t):
            self.mass[memory.row, :, entries] = state.ring[:, part]

    def closed_before(self, t: int) -> int:
        """The blocks a step after ``t`` cached tokens finds closed (the middle's full blocks)."""
        return (t - self.n_init - self.n_local) // self.block_size

    def list_length(self, w: int) -> int:
        """A selecting step's list for w queries: [own (decode) | sinks | chosen blocks | tail], the tail the
        remainder, the window (and a chunk's own tokens) at their longest."""
        return self.n_init + self.n_blocks * self.block_size + self.n_local + self.block_size - 1 + w

    # ---- the step ---------------------------------------------------------------------------------

    def graph_reads(self) -> tuple[torch.Tensor, ...]:
        return () if self.reprs is None else (self.reprs, self.table)

    def graph_state(self) -> tuple[torch.Tensor, ...]:
        return () if self.mass is None else (self.mass,)

    def attend(self, layer: int, step: SeqStep, q: torch.Tensor, own: torch.Tensor) -> Attended:
        """The step's list (``memory_list`` once it selects, else the whole table, with the fixed scheme's
        positions past the window). A decode step counts its query's attention on the window into its ring;
        a prefill chunk leaves its queries and the layer's list for ``prepare`` to count."""
        w = q.shape[0]
        if step.mode == SELECT:
            attended, tokens, own_col = self.memory_list(layer, step, q, own)
        else:
            attended = self.whole_table(step, w)
            n = step.table.numel()
            tokens, own_col = self.cache.arange(n), step.length.view(1)
            if step.mode == FIXED:  # the memory at 0, the window at 0..n_local-1, the queries from n_local on
                key_pos = step.once("infllm fixed", lambda: (tokens - (step.length - self.n_local)).clamp(min=0))
                attended = Attended(attended.slots, key_pos, self.n_local + self.cache.arange(w), attended.n_valid)
        if step.decode:
            self.count_own_query(layer, step, q, attended, tokens, own_col)
        else:
            saved_q, saved_list = step.buffers
            saved_q[layer].copy_(q)
            # the whole table of a chunk that attends everything is longer in a graph (its padded capacity) and
            # shorter eagerly than the buffer (``prepare``): its live entries, the first t + w, fit either way
            n = min(saved_list.shape[1], attended.slots.numel())
            saved_list[layer, :n].copy_(attended.slots[:n])
        return attended

    def memory_list(self, layer: int, step: SeqStep, q: torch.Tensor,
                    own: torch.Tensor) -> tuple[Attended, torch.Tensor, int]:
        """A selecting step's list, n_valid of it live: [own | sinks | the chosen blocks | the tail] for a decode
        step (the own token first, where the list's length does not move it: one query sees every live entry),
        [sinks | the chosen blocks | the tail] for a prefill chunk, whose own tokens end the tail's live part. The
        tail is the table from the first token after the closed blocks on: the remainder, the window (and a
        chunk's own tokens), read at its longest. Every layer writes its choice of blocks into one list.
        Returns (the list, the token indices of its entries from the tail on, the own token's entry).

        A layer's own work is the block scores, the top-k and one gather: the table's middle seen as rows of a block
        each (a view), the chosen rows copied into the list's middle (with "original", the same rows of an arange
        into its positions)."""
        n_init, n_local, bs, nb = self.n_init, self.n_local, self.block_size, self.n_blocks
        w = q.shape[0]
        first = 1 if step.decode else 0  # the own token's entry
        chosen = slice(first + n_init, first + n_init + nb * bs)
        tail = self.list_length(w) - first - n_init - nb * bs  # the tail's entries
        # what the layers share: the list and its positions, the tail's tokens (n_init + n_full * bs + 0, 1, ...:
        # n_init + 0, 1, ... is a view of the arange)
        n_full = step.once("infllm closed blocks", lambda: (step.length - (n_init + n_local)) // bs)
        tail_tokens = step.once("infllm tail tokens", lambda: torch.add(self.cache.arange(n_init + tail)[n_init:],
                                                                        n_full, alpha=bs))
        slots = step.once("infllm list", lambda: torch.cat([
            own[:first], step.table[:n_init], own.new_zeros(nb * bs),
            step.table[tail_tokens.clamp(max=step.table.numel() - 1)]]))
        n_valid = step.once("infllm live", lambda: torch.add(step.length, n_full, alpha=-bs) + (w + nb * bs))
        key_pos = step.once("infllm positions", lambda: self.list_positions(step, tail_tokens, n_valid, w))
        q_pos = key_pos[:1] if step.decode else step.once("infllm query positions", lambda: key_pos.index_select(
            0, n_valid - w + self.cache.arange(w)))
        # the sequence's row of the block table (index_select: indexing by a device scalar would read it on the host)
        pool_blocks = step.once("infllm pool blocks", lambda: self.table[:, :step.table.numel() // bs].index_select(
            0, step.row.view(1))[0])

        # the blocks: scored against this sequence's representatives, read where the pool holds them (the kernel
        # reads the query in its own dtype and computes in fp32)
        query = q[0] if step.decode else self.kernels.query_mean(q)
        scores = self.kernels.block_scores(self.reprs[layer].flatten(1), pool_blocks, query.flatten(), n_full)
        self.heads.sum(scores)  # summed over every rank's heads (``parallel.HeadReduce``)
        blocks = self.kernels.topk(scores, nb, n_full)  # n_full > nb once it selects: every pick is a closed block
        rows = (step.table.numel() - n_init) // bs  # the middle's blocks that the table holds whole (> n_full)
        torch.index_select(step.table[n_init:n_init + rows * bs].view(rows, bs), 0, blocks,
                           out=slots[chosen].view(nb, bs))
        if self.positions == "original":
            torch.index_select(self.cache.arange(n_init + rows * bs)[n_init:].view(rows, bs), 0, blocks,
                               out=key_pos[chosen].view(nb, bs))
        return Attended(slots, key_pos, q_pos, n_valid), tail_tokens, 0

    def count_own_query(self, layer: int, step: SeqStep, q: torch.Tensor, attended: Attended, tokens: torch.Tensor,
                        own_col: int | torch.Tensor) -> None:
        """A decode step's attention on its window, counted into the ring (q: [1, H, d]; tokens: the token indices
        of the list's last entries, those that may be in the window; own_col: the own token's entry, 0 in a
        selecting step's list, a device index [1] in the whole table): the own token's entry written, the window's
        others added to.

        What does not depend on the layer is computed once a step: the mask of the entries past the live ones, which
        of the tail's tokens are in the window, and the ring entries of the own token and of the tail's tokens in
        layer 0 of the sequence's row of ``mass``; a layer's entries are the same ones in a view of ``mass`` that
        starts at its ring (no index arithmetic per layer)."""
        n_local, ring = self.n_local, self.ring
        slots, n_valid = attended.slots, attended.n_valid
        tail_from = slots.numel() - tokens.numel()
        masked = step.once("infllm masked", lambda: torch.where(self.cache.arange(slots.numel()) >= n_valid,
                                                                float("-inf"), 0.0))
        # the window: tokens from max(n_init, length - n_local + 1) to length - 1 (a sink has no ring entry)
        windowed = step.once("infllm windowed", lambda: (
            (tokens >= (step.length - (n_local - 1)).clamp(min=self.n_init)) & (tokens < step.length)).float()[:, None])
        row_entry = step.once("infllm row entry", lambda: step.row * (self.n_layers * ring))
        tail_entries = step.once("infllm tail entries", lambda: row_entry + tokens % ring)
        own_entry = step.once("infllm own entry", lambda: (row_entry + step.length % ring).view(1))
        logits = self.kernels.paged_dot(q[0], self.cache.k[layer], slots)
        p = torch.softmax(torch.add(masked, logits, alpha=1.0 / math.sqrt(q.shape[-1])), dim=1)  # [H, n]
        mass = self.mass.view(-1, q.shape[1])[layer * ring:]  # entry e of layer 0 of a row is entry e here
        own_p = p[:, own_col:own_col + 1] if isinstance(own_col, int) else p.index_select(1, own_col)
        mass.index_copy_(0, own_entry, own_p.T)
        mass.index_add_(0, tail_entries, p[:, tail_from:].T * windowed)

    def list_positions(self, step: SeqStep, tail_tokens: torch.Tensor, n_valid: torch.Tensor, w: int) -> torch.Tensor:
        """The positions of a selecting step's list (the chosen blocks' are written by each layer with "original"):
        a decode step's own token first, a chunk's own tokens the tail's last live entries (positions after the
        window's). "fixed": the memory (the remainder too) at 0, the window at 0..n_local-1. tail_tokens: the tail's
        token indices; n_valid: the list's live entries, of which w are the step's own."""
        n_local = self.n_local
        memory = self.n_init + self.n_blocks * self.block_size
        if self.positions == "fixed":
            own, rest = self.cache.arange(n_local + 1)[n_local:], [
                torch.zeros(memory, dtype=torch.int64, device=tail_tokens.device),
                (tail_tokens - (step.length - n_local)).clamp(min=0)]
        elif self.positions == "reindex":  # 0, 1, ... through the list: one run of the arange
            return torch.cat([(n_valid - w).view(1), self.cache.arange(memory + tail_tokens.numel())]) if step.decode \
                else self.cache.arange(memory + tail_tokens.numel())
        else:
            own, rest = step.length.view(1), [self.cache.arange(memory), tail_tokens]
        return torch.cat([own, *rest] if step.decode else rest)


def _shape(saved: tuple[torch.Tensor, torch.Tensor]) -> tuple:
    """(the queries' [w, H, d], their dtype, the lists' length) of a set of saved buffers."""
    return tuple(saved[0].shape[1:]), saved[0].dtype, saved[1].shape[1]

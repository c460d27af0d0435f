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

The memory lives on the device, so that decode steps and a long prompt's prefill chunks can also run as one
CUDA graph each (``graph_list``): the representatives in a pool of blocks shared by all sequences (``reprs``; a
sequence's closed blocks are rows of it, listed in its row of ``table``, as the KV pool's slots are listed in a
slot table), and, a row per sequence, the attention received by the tokens not yet in a closed block (``mass``,
a ring indexed by token index). The blocks that leave the window are given their representatives on the host
before a graph step is launched (``graph_row``): one block every ``block_size`` decode steps, a chunk's worth
before a chunk. A decode step counts its own query's attention inside the graph. A prefill chunk leaves its
queries and each layer's list in ``saved_q`` and ``saved_list``, and its attention is counted from them on the
host, at the sequence's next step, as the eager path counts a chunk's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels import Kernels
from ..kv_cache import KVCache
from ..transfer import arange, to_device
from .base import GraphList, GraphSeq, Plan, SelectivePolicy, SeqView, selection_query

POOL_GROWTH = 1.25  # the pool of representatives grows by at least this factor (and to at least 256 blocks)


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
    closed blocks' representatives, in order (``table[row, :len(blocks)]`` on the device); layers: per layer."""

    row: int
    blocks: list[int]
    layers: list[Memory]


class InfLLM(SelectivePolicy):
    name = "infllm"
    POSITIONS = ("fixed", "reindex", "original")

    def __init__(self, cache: KVCache, kernels: Kernels, window: int, chunk: int = 512, k: int = 4096,
                 n_init: int = 128, n_local: int = 4096, block_size: int = 128, repr_keys: int = 4,
                 positions: str = "fixed"):
        if block_size < 1 or repr_keys < 1 or n_local < 1:
            raise ValueError("InfLLM's block_size, repr_keys and n_local must be >= 1 (its representatives come from "
                             "the attention tokens receive inside the local window)")
        self.n_blocks = k // block_size
        # at most n_blocks blocks + a remainder shorter than a block
        super().__init__(cache, kernels, n_init=n_init, n_local=n_local,
                         budget=self.n_blocks * block_size + block_size - 1, positions=positions)
        self.k, self.block_size, self.repr_keys = k, block_size, min(repr_keys, block_size)
        self.window = window
        self.n_layers = cache.k.shape[0]
        # the ring holds every token not yet in a closed block: before the first selection the whole context past
        # the sinks (at most budget + n_local, then a chunk), later the window, a block and the chunks around it
        self.ring = self.budget + n_local + 2 * (chunk + block_size)
        self.reprs: torch.Tensor | None = None  # [layers, pool blocks, H, d] fp32: the representatives
        self.free: list[int] = []  # pool blocks no sequence holds
        self.table: torch.Tensor | None = None  # [rows, blocks] int64: each sequence's pool blocks, in order
        self.mass: torch.Tensor | None = None  # [rows, layers, ring, H] fp32: the local scores
        # a graph prefill chunk's queries [layers, w, H, d] and each layer's list [layers, n], until counted
        self.saved_q: torch.Tensor | None = None
        self.saved_list: torch.Tensor | None = None
        self._saved_for: int | None = None  # the sequence whose pending counts read them
        self._memory: dict[int, SequenceMemory] = {}  # sequence id -> its memory

    # ---- device state ---------------------------------------------------------------------------

    def memory(self, layer: int, seq_id: int, n_heads: int, device: torch.device) -> Memory:
        """The layer's memory of sequence ``seq_id``, with a row of device state (taken on first use)."""
        if seq_id not in self._memory:
            taken = {seq.row for seq in self._memory.values()}
            row = next(r for r in range(len(taken) + 1) if r not in taken)
            self._reserve_rows(row + 1, n_heads, device)
            self._memory[seq_id] = SequenceMemory(row, [], [Memory(self.mass[row, layer], 0, self.n_init)
                                                            for layer in range(self.n_layers)])
        return self._memory[seq_id].layers[layer]

    def _reserve_rows(self, rows: int, n_heads: int, device: torch.device) -> None:
        """At least ``rows`` rows of the per-sequence state (the ring and the block table), keeping what they hold
        (grown tensors are new ones: the memories' views move to them, and a graph recorded with the old ones is
        recorded again, ``graph_reads``)."""
        have = 0 if self.mass is None else self.mass.shape[0]
        if rows <= have:
            return
        rows = max(rows, 2 * have)
        mass = torch.zeros(rows, self.n_layers, self.ring, n_heads, device=device)
        table = torch.zeros(rows, 0 if self.table is None else self.table.shape[1], dtype=torch.int64, device=device)
        if have:
            mass[:have], table[:have] = self.mass, self.table
        self.mass, self.table = mass, table
        for seq in self._memory.values():
            for layer, mem in enumerate(seq.layers):
                mem.ring = mass[seq.row, layer]
        if self.reprs is None:
            self.reprs = torch.zeros(self.n_layers, 0, n_heads, self.cache.k.shape[-1], device=device)

    def _reserve_table(self, n: int) -> None:
        """Room for ``n`` blocks in every row of the block table."""
        if self.table.shape[1] < n:
            wider = torch.zeros(self.table.shape[0], max(n, 2 * self.table.shape[1]), dtype=torch.int64,
                                device=self.table.device)
            wider[:, :self.table.shape[1]] = self.table
            self.table = wider

    def _reserve_blocks(self, seq: SequenceMemory, n: int) -> None:
        """Give the sequence pool blocks for its first ``n`` blocks."""
        self._reserve_table(n)
        new = n - len(seq.blocks)
        if new <= 0:
            return
        if len(self.free) < new:  # grow the pool, keeping what it holds
            have = self.reprs.shape[1]
            size = max(have + new - len(self.free), int(have * POOL_GROWTH), 256)
            reprs = self.reprs.new_zeros(self.n_layers, size, *self.reprs.shape[2:])
            reprs[:, :have] = self.reprs
            self.reprs = reprs
            self.free.extend(range(size - 1, have - 1, -1))
        taken = [self.free.pop() for _ in range(new)]
        self.table[seq.row, len(seq.blocks):n] = to_device(taken, self.table.device)
        seq.blocks.extend(taken)

    def ring_spans(self, start: int, stop: int) -> list[tuple[slice, slice]]:
        """Tokens start..stop-1 in the ring: (ring entries, the same tokens' offsets from start) pieces, at
        most two (where the ring wraps). Slices, not index tensors: the eager path launches no index kernel."""
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

    # ---- the eager path -------------------------------------------------------------------------

    def catch_up(self, layer: int, seq: SeqView, n_heads: int, device: torch.device) -> Memory:
        """The layer's memory of ``seq``, the last chunk's attention counted and every cached token in the ring."""
        mem = self.memory(layer, seq.id, n_heads, device)
        if mem.pending is not None:
            self.count_attention(layer, seq, mem)
        self.track(mem, seq.past.numel())
        return mem

    def plan(self, layer: int, seq: SeqView, q: torch.Tensor) -> Plan:
        mem = self.catch_up(layer, seq, q.shape[1], q.device)
        t, c = seq.past.numel(), q.shape[0]
        plan = super().plan(layer, seq, q)
        whole = plan.slots.numel() == t  # the budget covers the context: attended in order
        if self.positions == "fixed" and whole and t + c > self.window and t > self.n_local:
            plan.positions, plan.q_positions = self.place(arange(t, plan.slots.device), t, c)
        # a copy: q may be a view of a step graph's output buffer, which the next step overwrites before this is
        # read (and a view would keep the whole stacked q/k/v product alive meanwhile)
        mem.pending = (q.clone(), plan.slots, t)
        return plan

    def count_attention(self, layer: int, seq: SeqView, mem: Memory) -> None:
        """Add the pending chunk's local-window attention weights to the ring."""
        q, context, t0 = mem.pending
        mem.pending = None
        c = q.shape[0]
        t = t0 + c  # the chunk's keys are seq.past[t0:t] now
        self.track(mem, t)
        lo = max(self.tracked_from(mem), t0 - self.n_local + 1)  # oldest tracked key inside some query's window
        if lo >= t:
            return
        # the plan's context ends with the local window, so tokens lo..t-1 are the last columns
        attended = torch.cat([context, seq.past[t0:t]])
        scale = 1.0 / math.sqrt(q.shape[-1])
        mass = self.kernels.window_mass(q, self.cache.k[layer], attended, c, t0, lo, self.n_local, scale)
        for entries, part in self.ring_spans(lo, t):
            mem.ring[entries].add_(mass[part])

    def close_blocks(self, layer: int, seq: SeqView, mem: Memory, n_full: int) -> None:
        """Give representatives to the blocks mem.closed..n_full-1 of the middle, in this layer."""
        new, bs = n_full - mem.closed, self.block_size
        if new <= 0:
            return
        memory = self._memory[seq.id]
        self._reserve_blocks(memory, n_full)
        n_heads, d = self.reprs.shape[2:]
        start = self.tracked_from(mem)
        keys = self.cache.k[layer][seq.past[start:start + new * bs]].float()  # [new * bs, n_kv, d]
        keys = keys.repeat_interleave(n_heads // keys.shape[1], dim=1).view(new, bs, n_heads, d)
        parts = [mem.ring[entries] for entries, _ in self.ring_spans(start, start + new * bs)]
        scores = parts[0] if len(parts) == 1 else torch.cat(parts)
        top = scores.view(new, bs, n_heads).topk(self.repr_keys, dim=1).indices  # [new, r, H]
        chosen = keys.gather(1, top[..., None].expand(-1, -1, -1, d))  # [new, r, H, d]
        self.reprs[layer].index_copy_(0, self.table[memory.row, mem.closed:n_full], chosen.mean(dim=1))
        mem.closed = n_full

    def select(self, layer: int, seq: SeqView, q: torch.Tensor, middle: torch.Tensor) -> torch.Tensor:
        memory = self._memory[seq.id]
        n_full = middle.numel() // self.block_size
        self.close_blocks(layer, seq, memory.layers[layer], n_full)
        # sum_h <q_h, repr[b, h]> for the sequence's closed blocks, read where the pool holds them
        scores = self.kernels.block_scores(self.reprs[layer].flatten(1), self.table[memory.row, :n_full],
                                           selection_query(q).flatten())
        blocks = self.kernels.topk(scores, self.n_blocks)
        offsets = arange(self.block_size, middle.device)
        tokens = (blocks[:, None] * self.block_size + offsets[None, :]).flatten()
        remainder = arange(middle.numel(), middle.device)[n_full * self.block_size:]
        return torch.cat([tokens, remainder])

    def place(self, order: torch.Tensor, t: int, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """With "fixed": the memory at position 0, the local window at 0..n_local-1 and the chunk's
        queries from n_local on, so query i sees the memory at distance n_local + i."""
        if self.positions != "fixed":
            return super().place(order, t, c)
        dev = order.device
        at_zero = torch.zeros(order.numel() - self.n_local, dtype=torch.int64, device=dev)
        index = arange(self.n_local + c, dev)
        return torch.cat([at_zero, index[:self.n_local]]), index[self.n_local:]

    def representatives(self, seq_id: int, layer: int) -> torch.Tensor:
        """The representatives of a sequence's closed blocks in one layer: [blocks, H, d] fp32."""
        memory = self._memory[seq_id]
        return self.reprs[layer, memory.blocks[:memory.layers[layer].closed]]

    def release(self, seq_id: int) -> None:
        memory = self._memory.pop(seq_id, None)
        if memory is not None:
            self.free.extend(reversed(memory.blocks))

    # ---- steps as one graph -----------------------------------------------------------------------

    def graph_ready(self, t: int, c: int = 1) -> bool:
        """Past the selection threshold, where every step selects blocks (any position scheme)."""
        return t > self.n_init + self.budget + self.n_local

    def graph_row(self, seq: SeqView, capacity: int, q_shape: tuple[int, int, int], q_dtype: torch.dtype) -> int:
        """Bring the sequence's memory up to the step about to run, on the host: count its last step's attention
        (an eager chunk's, or a prefill graph's from ``saved_q``), give the blocks that have left the window their
        representatives, and make room in the block table for ``capacity`` tokens. A decode step starts its own
        token's ring entry itself. Before a prefill chunk the sequence gets pool blocks for every block its prompt
        (the graph's capacity) will close, so that the pool does not grow under the prompt's graph; its attention
        is left pending, to be counted from what the graph saves."""
        t, dev = seq.past.numel(), seq.past.device
        w, n_heads, _ = q_shape
        if not seq.decode:
            self._keep_saved(seq.id)
        for layer in range(self.n_layers):
            mem = self.catch_up(layer, seq, n_heads, dev)
            self.close_blocks(layer, seq, mem, self.closed_before(t))
            if seq.decode:
                mem.tracked = t + 1
        memory = self._memory[seq.id]
        self._reserve_table(capacity // self.block_size)
        if not seq.decode:
            self._reserve_blocks(memory, self.closed_before(capacity))
            if self.saved_q is None or self.saved_q.shape[1:] != q_shape or self.saved_q.dtype != q_dtype:
                self.saved_q = torch.zeros(self.n_layers, *q_shape, dtype=q_dtype, device=dev)
                self.saved_list = torch.zeros(self.n_layers, self.list_length(w), dtype=torch.int64, device=dev)
            # the list's live part before the chunk's own tokens: sinks, blocks, remainder, window
            context = self.n_blocks * self.block_size + t - self.closed_before(t) * self.block_size
            for layer, mem in enumerate(memory.layers):
                mem.pending = (self.saved_q[layer], self.saved_list[layer, :context], t)
            self._saved_for = seq.id
        return memory.row

    def _keep_saved(self, seq_id: int) -> None:
        """Before a graph prefill chunk of ``seq_id``: if another sequence's graph chunk is still to be counted,
        that sequence takes copies of its queries and lists, which this chunk overwrites."""
        owner = self._memory.get(self._saved_for) if self._saved_for != seq_id else None
        for mem in owner.layers if owner is not None else ():
            if mem.pending is not None and mem.pending[0]._base is self.saved_q:  # not counted, nor replaced
                q, context, t0 = mem.pending
                mem.pending = (q.clone(), context.clone(), t0)
        self._saved_for = None

    def closed_before(self, t: int) -> int:
        """The blocks a step after ``t`` cached tokens finds closed (the middle's full blocks)."""
        return (t - self.n_init - self.n_local) // self.block_size

    def list_length(self, w: int) -> int:
        """A graph step's list for w queries: [own (decode) | sinks | chosen blocks | tail], the tail the remainder,
        the window (and a chunk's own tokens) at their longest."""
        return self.n_init + self.n_blocks * self.block_size + self.n_local + self.block_size - 1 + w

    def graph_reads(self) -> tuple[torch.Tensor, ...]:
        return () if self.reprs is None else (self.reprs, self.table)

    def graph_state(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for t in (self.mass, self.saved_q, self.saved_list) if t is not None)

    def graph_list(self, layer: int, seq: GraphSeq, q: torch.Tensor, own: torch.Tensor) -> GraphList:
        """A step's list on the device, n_valid of it live: [own | sinks | the chosen blocks | the tail] for a
        decode step (the own token first, where the list's length does not move it: one query sees every live
        entry), [sinks | the chosen blocks | the tail] for a prefill chunk, whose own tokens end the tail's live
        part. The tail is the table from the first token after the closed blocks on: the remainder, the window
        (and a chunk's own tokens), read at its longest. Every layer writes its choice of blocks into one list.
        A decode step counts its query's attention on the window into its ring (the own token's entry written,
        the others' added to); a prefill chunk leaves its queries and the layer's list for ``graph_row``."""
        n_init, n_local, bs, nb = self.n_init, self.n_local, self.block_size, self.n_blocks
        dev, w = q.device, q.shape[0]
        first = 1 if seq.decode else 0  # the own token's entry
        chosen = slice(first + n_init, first + n_init + nb * bs)
        tail = arange(self.list_length(w) - first - n_init - nb * bs, dev)
        # what the layers share: the list and its positions, the tail's tokens and which of them are in the window
        n_full = seq.once("infllm closed blocks", lambda: (seq.length - (n_init + n_local)) // bs)
        tail_tokens = seq.once("infllm tail tokens", lambda: n_init + n_full * bs + tail)
        slots = seq.once("infllm list", lambda: torch.cat([
            own[:first], seq.table[:n_init], own.new_zeros(nb * bs),
            seq.table[tail_tokens.clamp(max=seq.table.numel() - 1)]]))
        n_valid = seq.once("infllm live", lambda: seq.length + w - n_full * bs + nb * bs)
        key_pos = seq.once("infllm positions", lambda: self.graph_positions(seq, n_full, tail))
        q_pos = key_pos[:1] if seq.decode else seq.once("infllm query positions", lambda: key_pos.index_select(
            0, n_valid - w + arange(w, dev)))
        # the sequence's row of the block table (index_select: indexing by a device scalar would read it on the host)
        pool_blocks = seq.once("infllm pool blocks", lambda: self.table[:, :seq.table.numel() // bs].index_select(
            0, seq.row.view(1))[0])

        # the blocks: scored against this sequence's representatives, read where the pool holds them
        query = q[0].float() if seq.decode else selection_query(q)
        scores = self.kernels.block_scores(self.reprs[layer].flatten(1), pool_blocks, query.flatten(), n_full)
        blocks = self.kernels.topk(scores, nb, n_full)
        tokens = (blocks[:, None] * bs + arange(bs, dev)[None, :]).flatten() + n_init
        torch.index_select(seq.table, 0, tokens, out=slots[chosen])
        if self.positions == "original":
            key_pos[chosen].copy_(tokens)
        if seq.decode:
            self.count_own_query(layer, seq, q, slots, n_valid, chosen.stop, tail_tokens)
        else:
            self.saved_q[layer].copy_(q)
            self.saved_list[layer].copy_(slots)
        return GraphList(slots, key_pos, q_pos, n_valid)

    def count_own_query(self, layer: int, seq: GraphSeq, q: torch.Tensor, slots: torch.Tensor, n_valid: torch.Tensor,
                        tail_from: int, tail_tokens: torch.Tensor) -> None:
        """A decode step's attention on its window, counted into the ring: what ``count_attention`` adds on the
        host for an eager step (q: [1, H, d]; slots: the step's list, own token first, n_valid live, the tail's
        tokens ``tail_tokens`` from entry ``tail_from`` on)."""
        n_local, ring, dev = self.n_local, self.ring, q.device
        dead = seq.once("infllm dead", lambda: arange(slots.numel(), dev) >= n_valid)
        windowed = seq.once("infllm windowed", lambda: (
            (seq.length - tail_tokens >= 1) & (seq.length - tail_tokens < n_local)).float()[:, None])
        tail_ring = seq.once("infllm tail ring", lambda: tail_tokens % ring)
        own_ring = seq.once("infllm own ring", lambda: (seq.length % ring).view(1))
        logits = self.kernels.paged_dot(q[0], self.cache.k[layer], slots).mul_(1.0 / math.sqrt(q.shape[-1]))
        p = torch.softmax(logits.masked_fill_(dead, float("-inf")), dim=1)  # [H, n]
        base = (seq.row * self.n_layers + layer) * ring
        mass = self.mass.view(-1, q.shape[1])
        mass.index_copy_(0, base + own_ring, p[:, :1].T)
        mass.index_add_(0, base + tail_ring, p[:, tail_from:].T * windowed)

    def graph_positions(self, seq: GraphSeq, n_full: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
        """The positions of the graph list (the chosen blocks' are written by each layer with "original"), as
        ``place`` gives them to the eager plan's [sinks | chosen | remainder | window] and its queries: a decode
        step's own token first, a chunk's own tokens the tail's last live entries (positions after the window's)."""
        n_init, n_local, bs, dev = self.n_init, self.n_local, self.block_size, tail.device
        memory = n_init + self.n_blocks * bs
        tail_len = seq.length - n_init - n_full * bs  # the remainder and the window
        if self.positions == "fixed":  # the memory (the remainder too) at 0, the window at 0..n_local-1
            own, rest = arange(n_local + 1, dev)[n_local:], [torch.zeros(memory, dtype=torch.int64, device=dev),
                                                               (tail - (tail_len - n_local)).clamp(min=0)]
        elif self.positions == "reindex":
            own, rest = (memory + tail_len).view(1), [arange(memory, dev), memory + tail]
        else:
            own, rest = seq.length.view(1), [arange(memory, dev), n_init + n_full * bs + tail]
        return torch.cat([own, *rest] if seq.decode else rest)

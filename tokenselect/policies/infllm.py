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

The memory lives on the device, so that a decode step can also run as one CUDA graph (``graph_list``):
the representatives in a pool of blocks shared by all sequences (``reprs``; a sequence's closed blocks are
rows of it, listed in its row of ``table``, as the KV pool's slots are listed in a slot table), and, a row per
sequence, the attention received by the tokens not yet in a closed block (``mass``, a ring indexed by token
index). A graph step counts its own query's attention at once; the blocks that leave the window are given
their representatives on the host before the step is launched (``graph_row``), one block every
``block_size`` steps.
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
    graph_prefill = False  # decode steps only: a chunk closes several blocks and counts c queries' attention

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

    # ---- decode steps as one graph ----------------------------------------------------------------

    def graph_ready(self, t: int) -> bool:
        """Past the selection threshold, where every step selects blocks (any position scheme)."""
        return t > self.n_init + self.budget + self.n_local

    def graph_row(self, seq: SeqView, capacity: int, query_size: int) -> int:
        """Bring the sequence's memory up to the decode step about to run, on the host: count the last eager
        chunk's attention, give the blocks that have left the window their representatives, and make room for
        the blocks of ``capacity`` tokens. The step starts its own token's ring entry itself."""
        t, dev = seq.past.numel(), seq.past.device
        n_heads = query_size // self.cache.k.shape[-1]
        for layer in range(self.n_layers):
            mem = self.catch_up(layer, seq, n_heads, dev)
            self.close_blocks(layer, seq, mem, (t - self.n_init - self.n_local) // self.block_size)
            mem.tracked = t + 1
        self._reserve_table(capacity // self.block_size)
        return self._memory[seq.id].row

    def graph_reads(self) -> tuple[torch.Tensor, ...]:
        return () if self.reprs is None else (self.reprs, self.table)

    def graph_state(self) -> tuple[torch.Tensor, ...]:
        return () if self.mass is None else (self.mass,)

    def graph_list(self, layer: int, seq: GraphSeq, q: torch.Tensor, own: torch.Tensor) -> GraphList:
        """A decode step's list on the device: [own | sinks | the chosen blocks | the tail], n_valid of it live.
        The tail is the remainder and the window, the table from the first token after the closed blocks to the
        step's, read at its longest (n_local + block_size - 1 entries; those past the length are not live). The
        own token comes first, where the list's length does not move it (one query sees every live entry).
        Every layer writes its choice of blocks into one list, and counts its query's attention on the window
        into its ring (the own token's entry written, the others' added to)."""
        n_init, n_local, bs, nb, ring = self.n_init, self.n_local, self.block_size, self.n_blocks, self.ring
        dev, n_heads = q.device, q.shape[1]
        chosen = slice(1 + n_init, 1 + n_init + nb * bs)
        tail = arange(n_local + bs - 1, dev)
        # what the layers share: the list and its positions, the tail's tokens and which of them are in the window
        n_full = seq.once("infllm closed blocks", lambda: (seq.length - (n_init + n_local)) // bs)
        tail_tokens = seq.once("infllm tail tokens", lambda: n_init + n_full * bs + tail)
        slots = seq.once("infllm list", lambda: torch.cat([
            own, seq.table[:n_init], own.new_zeros(nb * bs),
            seq.table[tail_tokens.clamp(max=seq.table.numel() - 1)]]))
        n_valid = seq.once("infllm live", lambda: seq.length - n_full * bs + 1 + nb * bs)
        dead = seq.once("infllm dead", lambda: arange(slots.numel(), dev) >= n_valid)
        key_pos = seq.once("infllm positions", lambda: self.graph_positions(seq, n_full, tail))
        windowed = seq.once("infllm windowed", lambda: (
            (seq.length - tail_tokens >= 1) & (seq.length - tail_tokens < n_local)).float()[:, None])
        tail_ring = seq.once("infllm tail ring", lambda: tail_tokens % ring)
        own_ring = seq.once("infllm own ring", lambda: (seq.length % ring).view(1))
        # the sequence's row of the block table (index_select: indexing by a device scalar would read it on the host)
        pool_blocks = seq.once("infllm pool blocks", lambda: self.table[:, :seq.table.numel() // bs].index_select(
            0, seq.row.view(1))[0])

        # the blocks: scored against this sequence's representatives, read where the pool holds them
        scores = self.kernels.block_scores(self.reprs[layer].flatten(1), pool_blocks, q[0].float().flatten(), n_full)
        blocks = self.kernels.topk(scores, nb, n_full)
        tokens = (blocks[:, None] * bs + arange(bs, dev)[None, :]).flatten() + n_init
        torch.index_select(seq.table, 0, tokens, out=slots[chosen])
        if self.positions == "original":
            key_pos[chosen].copy_(tokens)

        # the attention each window token receives from this query (what count_attention adds on the host)
        logits = self.kernels.paged_dot(q[0], self.cache.k[layer], slots).mul_(1.0 / math.sqrt(q.shape[-1]))
        p = torch.softmax(logits.masked_fill_(dead, float("-inf")), dim=1)  # [H, n]
        base = (seq.row * self.n_layers + layer) * ring
        mass = self.mass.view(-1, n_heads)
        mass.index_copy_(0, base + own_ring, p[:, :1].T)
        mass.index_add_(0, base + tail_ring, p[:, chosen.stop:].T * windowed)
        return GraphList(slots, key_pos, key_pos[:1], n_valid)

    def graph_positions(self, seq: GraphSeq, n_full: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
        """The positions of [own | sinks | chosen | tail] (the chosen blocks' are written by each layer with
        "original"), as ``place`` gives them to the eager plan's [sinks | chosen | remainder | window]."""
        n_init, n_local, bs, dev = self.n_init, self.n_local, self.block_size, tail.device
        memory = n_init + self.n_blocks * bs
        tail_len = seq.length - n_init - n_full * bs  # the remainder and the window
        if self.positions == "fixed":  # the memory (the remainder too) at 0, the window at 0..n_local-1
            return torch.cat([arange(n_local + 1, dev)[n_local:], torch.zeros(memory, dtype=torch.int64, device=dev),
                              (tail - (tail_len - n_local)).clamp(min=0)])
        if self.positions == "reindex":
            return torch.cat([(memory + tail_len).view(1), arange(memory, dev), memory + tail])
        return torch.cat([seq.length.view(1), arange(memory, dev), n_init + n_full * bs + tail])

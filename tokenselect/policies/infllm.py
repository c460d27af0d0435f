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
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels import Kernels
from ..kv_cache import KVCache
from ..transfer import arange
from .base import Plan, SelectivePolicy, SeqView, selection_query


@dataclass
class Memory:
    """One sequence's context memory in one layer.

    reprs: [B, H, d] fp32, the representative key of each finished block, per query head.
    scores: [L, H] fp32, local-window attention received by the tokens after the finished blocks
        (token indices n_init + B * block_size onwards).
    pending: the last chunk's queries [c, H, d], the context slots it attended [n] and its first
        token index, until their attention weights are counted.
    """

    reprs: torch.Tensor
    scores: torch.Tensor
    pending: tuple[torch.Tensor, torch.Tensor, int] | None = None


class InfLLM(SelectivePolicy):
    name = "infllm"
    POSITIONS = ("fixed", "reindex", "original")

    def __init__(self, cache: KVCache, kernels: Kernels, window: int, k: int = 4096, n_init: int = 128,
                 n_local: int = 4096, block_size: int = 128, repr_keys: int = 4, positions: str = "fixed"):
        if block_size < 1 or repr_keys < 1:
            raise ValueError("block_size and repr_keys must be >= 1")
        self.n_blocks = k // block_size
        # at most n_blocks blocks + a remainder shorter than a block
        super().__init__(cache, kernels, n_init=n_init, n_local=n_local,
                         budget=self.n_blocks * block_size + block_size - 1, positions=positions)
        self.k, self.block_size, self.repr_keys = k, block_size, min(repr_keys, block_size)
        self.window = window
        self._memory: dict[int, dict[int, Memory]] = {}  # seq id -> layer -> memory

    def plan(self, layer: int, seq: SeqView, q: torch.Tensor) -> Plan:
        mem = self.memory(layer, seq, q)
        if mem.pending is not None:
            self.count_attention(layer, seq, mem)
        plan = super().plan(layer, seq, q)
        t, c = seq.past.numel(), q.shape[0]
        whole = plan.slots.numel() == t  # the budget covers the context: attended in order
        if self.positions == "fixed" and whole and t + c > self.window and t > self.n_local:
            plan.positions, plan.q_positions = self.place(arange(t, plan.slots.device), t, c)
        # a copy: q may be a view of a step graph's output buffer, which the next step overwrites before this is
        # read (and a view would keep the whole stacked q/k/v product alive meanwhile)
        mem.pending = (q.clone(), plan.slots, t)
        return plan

    def memory(self, layer: int, seq: SeqView, q: torch.Tensor) -> Memory:
        """The layer's memory for ``seq``, its scores grown to cover every token in ``seq.past``."""
        layers = self._memory.setdefault(seq.id, {})
        if layer not in layers:
            h, d, dev = q.shape[1], q.shape[2], q.device
            layers[layer] = Memory(torch.empty(0, h, d, device=dev), torch.empty(0, h, device=dev))
        mem = layers[layer]
        missing = seq.past.numel() - self.tracked_from(mem) - mem.scores.shape[0]
        if missing > 0:
            mem.scores = torch.cat([mem.scores, mem.scores.new_zeros(missing, mem.scores.shape[1])])
        return mem

    def tracked_from(self, mem: Memory) -> int:
        """Token index of ``mem.scores[0]``."""
        return self.n_init + mem.reprs.shape[0] * self.block_size

    def count_attention(self, layer: int, seq: SeqView, mem: Memory) -> None:
        """Add the pending chunk's local-window attention weights to ``mem.scores``."""
        q, context, t0 = mem.pending
        mem.pending = None
        c = q.shape[0]
        t = t0 + c  # the chunk's keys are seq.past[t0:t] now
        start = self.tracked_from(mem)
        lo = max(start, t0 - self.n_local + 1)  # oldest tracked key inside some query's window
        if lo >= t:
            return
        # the plan's context ends with the local window, so tokens lo..t-1 are the last columns
        attended = torch.cat([context, seq.past[t0:t]])
        scale = 1.0 / math.sqrt(q.shape[-1])
        mem.scores[lo - start:t - start] += self.kernels.window_mass(q, self.cache.k[layer], attended, c, t0, lo,
                                                                     self.n_local, scale)

    def close_blocks(self, layer: int, seq: SeqView, mem: Memory, n_full: int) -> None:
        """Give representatives to the blocks 0..n_full-1 of the middle that have none yet."""
        new, bs = n_full - mem.reprs.shape[0], self.block_size
        if new <= 0:
            return
        start = self.tracked_from(mem)
        n_heads, d = mem.reprs.shape[1:]
        keys = self.cache.k[layer][seq.past[start:start + new * bs]].float()  # [new * bs, n_kv, d]
        keys = keys.repeat_interleave(n_heads // keys.shape[1], dim=1).view(new, bs, n_heads, d)
        top = mem.scores[:new * bs].view(new, bs, n_heads).topk(self.repr_keys, dim=1).indices  # [new, r, H]
        chosen = keys.gather(1, top[..., None].expand(-1, -1, -1, d))  # [new, r, H, d]
        mem.reprs = torch.cat([mem.reprs, chosen.mean(dim=1)])
        mem.scores = mem.scores[new * bs:]

    def select(self, layer: int, seq: SeqView, q: torch.Tensor, middle: torch.Tensor) -> torch.Tensor:
        mem = self._memory[seq.id][layer]
        n_full = middle.numel() // self.block_size
        self.close_blocks(layer, seq, mem, n_full)
        scores = mem.reprs.flatten(1) @ selection_query(q).flatten()  # [n_full]: sum_h <q_h, repr[b, h]>
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

    def release(self, seq_id: int) -> None:
        self._memory.pop(seq_id, None)

"""The attention policy interface and the selection plumbing every sparse policy shares.

A policy answers one question: for these queries of this layer, which cache slots are attended,
and at which RoPE positions? The engine then runs sparse attention over
``[plan.slots..., the chunk's own slots...]`` with causality inside the chunk.

Selective policies attend ``[n_init sink tokens | chosen middle tokens, in original order |
n_local most recent tokens]``. They differ only in how they choose from the middle
(``SelectivePolicy.select``); splitting the context, assembling the list and placing it at
positions is done here once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..kernels import Kernels
from ..kv_cache import KVCache
from ..transfer import arange


@dataclass
class Plan:
    """What one sequence's chunk attends in one layer.

    slots: [n] context slots (tokens before the chunk), in attention order.
    positions: [n] RoPE positions of those keys.
    q_positions: [c] RoPE positions of the chunk's queries (and of its own keys).
    """

    slots: torch.Tensor
    positions: torch.Tensor
    q_positions: torch.Tensor


@dataclass
class SeqView:
    """What a policy sees of a sequence for one chunk.

    id: the sequence id (keys the policy's per-sequence state).
    past: [T] slots of the tokens already in the cache before this chunk, in order.
    decode: True for a generation step (one new token after the prompt).
    """

    id: int
    past: torch.Tensor
    decode: bool


@dataclass
class GraphSeq:
    """A sequence inside a step captured as one CUDA graph (``whole_graphs.py``): what a policy reads, as
    device tensors of shapes fixed for the graph's life.

    table: [C] slots of the sequence's tokens 0..C-1: the ``length`` cached ones, then the step's own (w
        of them); the entries after those are not the sequence's and must never be attended (they hold
        some valid slot, so reading them is harmless).
    length: int64 [], the tokens in the cache before this step.
    row: int64 [], the sequence's row in the policy's per-sequence state (``graph_row``).
    decode: True for a decode step (one query), False for a prefill chunk (which never reuses a selection).

    One GraphSeq serves every layer of a step, so what depends on the step alone is computed once
    (``once``), not in each of the layers: in a graph each computation is a node per layer.
    """

    table: torch.Tensor
    length: torch.Tensor
    row: torch.Tensor
    decode: bool
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def once(self, key: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        """``make()``, computed by the first layer that asks for ``key`` and kept for the step's other layers."""
        if key not in self._derived:
            self._derived[key] = make()
        return self._derived[key]


@dataclass
class GraphList:
    """What a graph step's w queries attend (``AttentionPolicy.graph_list``), as device tensors.

    slots: [n] (n fixed for the graph's life) cache slots, the step's own tokens last among the live ones (a
        decode step's one token may stand anywhere among them: it sees every live entry).
    key_pos: [n] their RoPE positions; q_pos: [w] the queries'.
    n_valid: None (all n are attended) or int64 []: only ``slots[:n_valid]`` are.
    """

    slots: torch.Tensor
    key_pos: torch.Tensor
    q_pos: torch.Tensor
    n_valid: torch.Tensor | None


class AttentionPolicy:
    """Base class. Subclasses set ``name`` and implement ``plan``; those that can plan a step on the device
    alone (``graph_ready``) also implement ``graph_list``."""

    name = "base"

    def __init__(self, cache: KVCache, kernels: Kernels):
        self.cache, self.kernels = cache, kernels

    def plan(self, layer: int, seq: SeqView, q: torch.Tensor) -> Plan:
        """q: [c, n_heads, head_dim], un-rotated queries of the chunk."""
        raise NotImplementedError

    def release(self, seq_id: int) -> None:
        """Forget the per-sequence state of a finished sequence."""

    def stats(self) -> dict:
        return {}

    # ---- steps captured whole as CUDA graphs --------------------------------------------------

    def graph_ready(self, t: int, c: int = 1) -> bool:
        """Whether a step of ``c`` tokens (a decode token or a prefill chunk) after ``t`` cached tokens can be
        planned by ``graph_list``."""
        return False

    def graph_list(self, layer: int, seq: GraphSeq, q: torch.Tensor, own: torch.Tensor) -> GraphList:
        """What the queries q: [w, n_heads, head_dim] (a decode token, w = 1, or a prefill chunk, per
        ``seq.decode``), cached at slots own: [w], attend, computed on the device: the context ``plan`` would
        choose at ``plan``'s positions, then their own tokens."""
        raise NotImplementedError

    def graph_row(self, seq: SeqView, capacity: int, q_shape: tuple[int, int, int], q_dtype: torch.dtype) -> int:
        """The sequence's row in the policy's per-sequence device state (``GraphSeq.row``), called on the host
        before each graph step of the sequence (``seq.past``: its cached tokens' slots; capacity: the step's
        table length; q_shape, q_dtype: the step's queries of the sequence, [w, n_heads, head_dim])."""
        return 0

    def graph_state(self) -> tuple[torch.Tensor, ...]:
        """The device tensors a graph step reads and writes besides the cache: a graph is captured for
        these very tensors, and a warm-up run restores them."""
        return ()

    def graph_reads(self) -> tuple[torch.Tensor, ...]:
        """The device tensors a graph step only reads (besides the cache and the step's inputs): a graph is
        captured for these very tensors."""
        return ()


def contiguous_plan(seq: SeqView, c: int) -> Plan:
    """Attend every past token at its original position (full attention)."""
    t = seq.past.numel()
    index = arange(t + c, seq.past.device)
    return Plan(seq.past, index[:t], index[t:])


class SelectivePolicy(AttentionPolicy):
    """Sinks + chosen middle tokens + local window, re-indexed to contiguous positions.

    n_init: sink tokens at the start; n_local: most recent tokens; budget: at most this many
    middle tokens are chosen. positions: "reindex" (RoPE by index within the attended list, so
    positions never exceed n_init + budget + n_local + chunk) or "original" (cache positions).
    """

    POSITIONS = ("reindex", "original")  # the schemes ``place`` knows; subclasses may add their own

    dense_until = 0  # see ``attends_all``; TokenSelect sets it

    def __init__(self, cache: KVCache, kernels: Kernels, n_init: int, n_local: int, budget: int,
                 positions: str = "reindex"):
        super().__init__(cache, kernels)
        if positions not in self.POSITIONS:
            raise ValueError(f"positions must be one of {', '.join(self.POSITIONS)}, not {positions!r}")
        if min(n_init, n_local, budget) < 0:
            raise ValueError("n_init, n_local and the selection budget must be >= 0")
        self.n_init, self.n_local, self.budget, self.positions = n_init, n_local, budget, positions

    def select(self, layer: int, seq: SeqView, q: torch.Tensor, middle: torch.Tensor) -> torch.Tensor:
        """Choose from the middle of the cache. q: [c, n_heads, head_dim]; middle: [M] slots.
        Returns indices into ``middle`` (sorted, unique, at most ``budget``)."""
        raise NotImplementedError

    def attends_all(self, t: int, c: int) -> bool:
        """Whether a step of ``c`` tokens after ``t`` cached ones attends every token at its own position, as
        full attention does: while the list would hold them all anyway, and while the step's last position
        stays below ``dense_until`` (a model is not made worse at lengths its window already handles)."""
        return t <= self.n_init + self.budget + self.n_local or t + c <= self.dense_until

    def plan(self, layer: int, seq: SeqView, q: torch.Tensor) -> Plan:
        t, c = seq.past.numel(), q.shape[0]
        if self.attends_all(t, c):
            return contiguous_plan(seq, c)
        chosen = self.select(layer, seq, q, seq.past[self.n_init:t - self.n_local])
        return self.assemble(seq, chosen, c)

    def assemble(self, seq: SeqView, chosen: torch.Tensor, c: int) -> Plan:
        """The plan attending ``[sinks | middle[chosen] | local window]`` of ``seq.past`` for a chunk of
        ``c`` queries. chosen: sorted indices into the middle, ``seq.past[n_init:t - n_local]``."""
        t, dev = seq.past.numel(), seq.past.device
        index = arange(t, dev)
        order = torch.cat([index[:self.n_init], chosen.to(dev) + self.n_init, index[t - self.n_local:]])
        positions, q_positions = self.place(order, t, c)
        return Plan(seq.past[order], positions, q_positions)

    def place(self, order: torch.Tensor, t: int, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE positions for the attended tokens ``order: [n]`` (token indices) and the chunk."""
        if self.positions == "original":
            return order, arange(t + c, order.device)[t:]
        n = order.numel()
        index = arange(n + c, order.device)
        return index[:n], index[n:]

    def graph_ready(self, t: int, c: int = 1) -> bool:
        """Subclasses that implement ``graph_choose`` can plan a step on the device once it selects
        (``attends_all`` is false), with positions by index in the list (which then never move)."""
        return (type(self).graph_choose is not SelectivePolicy.graph_choose and self.positions == "reindex"
                and not self.attends_all(t, c))

    def graph_list(self, layer: int, seq: GraphSeq, q: torch.Tensor, own: torch.Tensor) -> GraphList:
        """[sinks | chosen | local window | own] at positions 0, 1, ...: one list a step, assembled by the first
        layer (the sinks, the window gathered at the sequence's current length, the step's own tokens), into
        whose middle every layer writes its own choice (``graph_choose``). The layers run in order on one
        stream, so a layer's list holds its choice until the next layer's ``graph_list``."""
        n_init, k = self.n_init, self.budget
        frame = seq.once(f"{n_init} sinks + {k} chosen + last {self.n_local} + own", lambda: torch.cat([
            seq.table[:n_init + k],  # the k after the sinks only hold the place of the chosen
            seq.table[seq.length - self.n_local + arange(self.n_local, q.device)], own]))
        self.graph_choose(layer, seq, q, frame[n_init:n_init + k])
        positions = arange(frame.numel(), q.device)
        return GraphList(frame, positions, positions[frame.numel() - own.numel():], None)

    def graph_choose(self, layer: int, seq: GraphSeq, q: torch.Tensor, out: torch.Tensor) -> None:
        """Write the slots of the middle tokens a step attends, [budget] in order, to ``out``, on the device."""
        raise NotImplementedError


def selection_query(q: torch.Tensor) -> torch.Tensor:
    """The query a chunk selects with: the mean of its un-rotated queries (TokenSelect 5.2).
    q: [c, n_heads, head_dim] -> [n_heads, head_dim] fp32 (one kernel: the mean accumulates in fp32)."""
    return q.mean(dim=0, dtype=torch.float32)

"""Attention for one forward pass over a flat batch that mixes several sequences' chunks.

The model hands each layer's un-rotated q, k, v here. The new k, v go into the paged cache; then,
per sequence, its policy (``seq.policy``: the engine's, or one built for the request's own settings)
says what the chunk attends (``AttentionPolicy.attend``) and the sparse attention kernel runs over that
list, the chunk's own slots among it, with RoPE at the positions the policy gave. With
value offload the kernel reads those slots' K and V rows staged on the device
(``KVCache.attention_pools``) instead of the pools.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import Kernels
from .kv_cache import KVCache
from .policies.base import AttentionPolicy, EagerStep, SeqStep, rows, start_steps
from .rope import RopeSpec
from .sequence import Sequence


@dataclass
class Chunk:
    """Rows [start, start + length) of the batch are tokens past..past+length-1 of ``seq``."""

    seq: Sequence
    start: int
    length: int
    past: int

    @property
    def decode(self) -> bool:
        return self.past >= len(self.seq.prompt_ids)


class RopeFrequencies:
    """inv_freq on the compute device, recomputed only where it depends on length (dynamic NTK)."""

    def __init__(self, spec: RopeSpec, device: torch.device):
        self.spec, self.device = spec, device
        inv_freq, self.scale = spec.inv_freq()
        self._static = inv_freq.to(device)

    def __call__(self, q_positions: torch.Tensor) -> tuple[torch.Tensor, float]:
        """Frequencies for a chunk whose last query sits at ``q_positions[-1]``. Only dynamic NTK depends on
        it, computed on the device (no host read: the same in a CUDA graph)."""
        if self.spec.kind != "dynamic":
            return self._static, self.scale
        return self.spec.dynamic_inv_freq(q_positions[-1:] + 1, self._static), self.scale


class BatchAttention:
    """The attention context the model calls: ``attention(layer, q, k, v)``. Built for one step: every chunk's
    policy prepares its sequence (``AttentionPolicy.prepare``) before the first layer runs.

    The step's decode tokens come first (``Scheduler.schedule``). Where two or more of them share a policy that
    chooses for a batch at once (``AttentionPolicy.batch_choice``) and select, they attend as a whole-step graph's
    batch does (``attend_batch``: their slot tables as rows of one table padded to the longest); a step that also
    prefills a prompt's chunk (continuous batching) then selects for them in one launch of each kernel a layer,
    not one a sequence."""

    def __init__(self, cache: KVCache, kernels: Kernels, rope: RopeFrequencies, chunks: list[Chunk],
                 new_slots: torch.Tensor, q_shape: tuple[int, int], q_dtype: torch.dtype):
        """q_shape: (n_heads, head_dim) of the model's queries, q_dtype their dtype."""
        self.cache, self.kernels, self.rope = cache, kernels, rope
        self.chunks, self.new_slots = chunks, new_slots
        self.steps = start_steps([EagerStep(ch.seq.policy, ch.seq.id, ch.seq.slots, ch.past, ch.length, ch.decode,
                                            (ch.length, *q_shape), q_dtype) for ch in chunks])
        self.together = self._decodes_together()

    def _decodes_together(self) -> list[SeqStep]:
        """The SeqSteps of the leading decode chunks that attend as one batch (over a padded table), or []."""
        first = self.chunks[0].seq.policy
        n = 0
        for ch, step in zip(self.chunks, self.steps):
            if not (ch.decode and ch.length == 1 and ch.start == n and ch.seq.policy is first
                    and step.mode == self.steps[0].mode):
                break
            n += 1
        # (as a whole step's graph: not where a padded table would stage values from the host beyond the live ones)
        if n < 2 or not first.batch_choice or not first.graph_ready(self.chunks[0].past):
            return []
        longest = max(ch.past for ch in self.chunks[:n]) + 1
        table = torch.zeros(n, longest, dtype=torch.int64, device=self.new_slots.device)
        fill_tables(table, self.chunks[:n])
        return [SeqStep(table[b], step.length, step.row, True, step.mode, step.buffers)
                for b, step in enumerate(self.steps[:n])]

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [n, n_heads, d], k, v: [n, n_kv_heads, d], un-rotated -> [n, n_heads, d]."""
        self.cache.write(layer, self.new_slots, k, v)
        out = torch.empty_like(q)
        n = len(self.together)
        if n:
            out[:n] = attend_batch(self.chunks[0].seq.policy, self.cache, self.kernels, self.rope, layer,
                                   self.together, q[:n, None], self.new_slots[:n, None])[:, 0]
        for ch, step in zip(self.chunks[n:], self.steps[n:]):
            rows = slice(ch.start, ch.start + ch.length)
            own = ch.seq.slots[ch.past:ch.past + ch.length]
            out[rows] = attend(ch.seq.policy, self.cache, self.kernels, self.rope, layer, step, q[rows], own)
        return out


def fill_tables(table: torch.Tensor, chunks: list[Chunk]) -> None:
    """Row b of table: [B, C] <- the slots of chunk b's cached tokens and its own (a step's tables padded to one
    length C; the entries past them are not the sequence's, and never attended)."""
    for b, ch in enumerate(chunks):
        table[b, :ch.past + ch.length].copy_(ch.seq.slots[:ch.past + ch.length])


def attend(policy: AttentionPolicy, cache: KVCache, kernels: Kernels, rope: RopeFrequencies, layer: int,
           step: SeqStep, q: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """One sequence's queries q: [w, n_heads, d] (un-rotated; their keys already cached at slots ``own``) over
    what its policy chooses, with RoPE at the chosen positions -> [w, n_heads, d]. The same eagerly and in a
    CUDA graph (``attend_batch`` for a batch of one: its operands are views, nothing is copied)."""
    return attend_batch(policy, cache, kernels, rope, layer, [step], q[None], own[None])[0]


def attend_batch(policy: AttentionPolicy, cache: KVCache, kernels: Kernels, rope: RopeFrequencies, layer: int,
                 steps: list[SeqStep], q: torch.Tensor, own: torch.Tensor) -> torch.Tensor:
    """``attend`` for B sequences of one policy and mode, whose lists have one length (a whole-step graph's
    batch): q: [B, w, n_heads, d], own: [B, w] -> [B, w, n_heads, d], the policy's choices made for the
    batch (``AttentionPolicy.attend_batch``: TokenSelect's decode steps in one launch of each selection kernel) and
    one attention launch for all (one node a layer in a graph, not B, and a grid over every sequence). A prefill
    chunk whose policy chooses for groups of its queries (``AttentionPolicy.query_groups``) runs its full groups as
    such a batch, then the rest as one more."""
    groups = policy.query_groups(steps[0], q.shape[1]) if len(steps) == 1 else None
    if groups is not None:
        g, groups = groups
        full = q.shape[1] // g * g  # the queries of the full groups
        outs = [attend_batch(policy, cache, kernels, rope, layer, groups[:full // g], q[0, :full].reshape(
            -1, g, *q.shape[2:]), own[0, :full].reshape(-1, g)).reshape(1, full, *q.shape[2:])]
        if full < q.shape[1]:
            outs.append(attend_batch(policy, cache, kernels, rope, layer, groups[full // g:], q[:, full:],
                                     own[:, full:]))
        return torch.cat(outs, dim=1) if len(outs) > 1 else outs[0]
    # one sequence: its policy's ``attend``, what every policy implements (and tools that record lists wrap)
    lists = [policy.attend(layer, steps[0], q[0], own[0])] if len(steps) == 1 else policy.attend_batch(
        layer, steps, q, own)
    frequencies = [rope(a.q_pos) for a in lists]
    k_pool, v_pool, slots = cache.attention_pools(layer, rows([a.slots for a in lists]))
    n_valid = None if lists[0].n_valid is None else rows([a.n_valid.view(1) for a in lists]).view(-1)
    return kernels.sparse_attention(q, k_pool, v_pool, slots, rows([a.key_pos for a in lists]),
                                    rows([a.q_pos for a in lists]), rows([f[0] for f in frequencies]),
                                    frequencies[0][1], n_valid=n_valid)

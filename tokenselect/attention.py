"""Attention for one forward pass over a flat batch that mixes several sequences' chunks.

The model hands each layer's un-rotated q, k, v here. The new k, v go into the paged cache; then,
per sequence, its policy (``seq.policy``: the engine's, or one built for the request's own settings)
plans what the chunk attends and the sparse attention kernel runs over
``[planned context slots..., the chunk's own slots...]`` with RoPE at the planned positions. With
value offload the kernel reads those slots' K and V rows staged on the device
(``KVCache.attention_pools``) instead of the pools.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .kernels import Kernels
from .kv_cache import KVCache
from .policies import SeqView
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
        """Frequencies for a chunk whose last query sits at ``q_positions[-1]``. Only dynamic NTK
        reads the position (a host sync), the other kinds never depend on it."""
        if self.spec.kind != "dynamic":
            return self._static, self.scale
        length = int(q_positions[-1]) + 1
        if length <= self.spec.max_position:
            return self._static, self.scale
        inv_freq, scale = self.spec.inv_freq(length)
        return inv_freq.to(self.device), scale


class BatchAttention:
    """The attention context the model calls: ``attention(layer, q, k, v)``."""

    def __init__(self, cache: KVCache, kernels: Kernels, rope: RopeFrequencies, chunks: list[Chunk],
                 new_slots: torch.Tensor):
        self.cache, self.kernels, self.rope = cache, kernels, rope
        self.chunks, self.new_slots = chunks, new_slots

    def attention(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q: [n, n_heads, d], k, v: [n, n_kv_heads, d], un-rotated -> [n, n_heads, d]."""
        self.cache.write(layer, self.new_slots, k, v)
        out = torch.empty_like(q)
        for ch in self.chunks:
            rows = slice(ch.start, ch.start + ch.length)
            seq_slots = ch.seq.slots
            plan = ch.seq.policy.plan(layer, SeqView(ch.seq.id, seq_slots[:ch.past], ch.decode), q[rows])
            slots = torch.cat([plan.slots, seq_slots[ch.past:ch.past + ch.length]])
            positions = torch.cat([plan.positions, plan.q_positions])
            inv_freq, scale = self.rope(plan.q_positions)
            k_pool, v_pool, slots = self.cache.attention_pools(layer, slots)
            out[rows] = self.kernels.sparse_attention(
                q[rows], k_pool, v_pool, slots, positions, plan.q_positions, inv_freq, scale)
        return out

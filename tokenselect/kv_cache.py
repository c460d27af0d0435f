"""Paged KV cache with a page size of one token.

One pool of token slots serves every sequence and every layer: ``k[layer]: [n_slots, n_kv_heads,
head_dim]``. Keys are stored *before* RoPE, so any attention policy can rotate them at whatever
positions it chooses. A sequence owns an ordered list of slots (its slot table, in the engine);
the allocator hands out and takes back slots through a free list.
"""

from __future__ import annotations

import torch

from .errors import KVPoolFull


class KVCache:
    def __init__(self, n_layers: int, n_slots: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (n_layers, n_slots, n_kv_heads, head_dim)
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.v = torch.empty(shape, dtype=dtype, device=device)
        self.n_slots = n_slots
        # Free list as a stack: slots [0, _top) of _stack are free; allocation pops from the top.
        self._stack = torch.arange(n_slots - 1, -1, -1, dtype=torch.int64, device=device)
        self._top = n_slots

    @property
    def num_free(self) -> int:
        return self._top

    def allocate(self, n: int) -> torch.Tensor:
        """Take ``n`` free slots -> [n] int64. Raises KVPoolFull, touching nothing, if fewer are free."""
        if n > self._top:
            raise KVPoolFull(f"KV pool full: {n} slots requested, {self._top} of {self.n_slots} free")
        self._top -= n
        return self._stack[self._top:self._top + n].flip(0).clone()

    def free(self, slots: torch.Tensor) -> None:
        """Return slots ``[n]`` to the pool."""
        n = slots.numel()
        self._stack[self._top:self._top + n] = slots.flip(0)
        self._top += n

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store un-rotated ``k, v: [n, n_kv_heads, head_dim]`` at ``slots: [n]`` (cast to the pool's
        dtype, e.g. fp8 storage)."""
        self.k[layer, slots] = k.to(self.k.dtype)
        self.v[layer, slots] = v.to(self.v.dtype)

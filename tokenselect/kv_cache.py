"""Paged KV cache with a page size of one token.

One pool of token slots serves every sequence and every layer: ``k[layer]: [n_slots, n_kv_heads,
head_dim]``. Keys are stored *before* RoPE, so any attention policy can rotate them at whatever
positions it chooses. A sequence owns an ordered list of slots (its slot table, in the engine);
the allocator hands out and takes back slots through a free list.

Value offload (``offload="values"``) keeps the V pool in host memory and only K on the device:
selection reads every key, but attention needs the values of the attended slots alone, so ``stage``
gathers just those rows for each chunk and layer. Policies read ``k`` only, never ``v``. Each layer's last
staged rows (up to ``kept_rows``) stay on the device, and a row staged again is copied from there rather than
over the bus (``row_copy.stage_rows``): a decode step attends mostly what the step before it attended. With a GPU
the host pool is page-locked and mapped into the GPU's address space, and the GPU itself writes new
values into it and gathers the attended rows from it (``kernels/row_copy.py``), in the step's stream:
the host never waits, and a step with offloaded values can run as one CUDA graph. (These copies use the
Triton kernels whatever the engine's ``kernels`` setting: only a kernel can reach host memory from the GPU.)

Selection keys (``select_dtype``, e.g. fp8): a second copy of the keys in a narrower dtype, written with
them, that the policies which score every key (TokenSelect, ReAttention) read instead of ``k``: a
selection reads half the bytes of bf16 keys, while attention still reads ``k`` and ``v`` at full
precision. Without it (or when the pool is already stored in that dtype) ``k_select`` is ``k`` itself.
"""

from __future__ import annotations

import math
import os
import weakref

import torch

from .errors import KVPoolFull
from .kernels.row_copy import (Kept, gather_rows, gather_rows_ref, scatter_rows, scatter_rows_ref, stage_rows,
                               stage_rows_ref)
from .transfer import Aranges

OFFLOAD_MODES = ("none", "values")
# rows of a layer's staged values kept on the device with value offload: a decode step's 2,689 (TokenSelect's
# defaults) for 3 sequences; 8 MiB a layer of Llama-3-8B's fp8 values
KEPT_ROWS = 8192
KEPT_INDEX_BYTES = 4  # a slot's device bytes a layer with value offload: where its values were last kept (int32)
CUDA_HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped: kernels may read and write the memory in place


class HostMemoryError(ValueError):
    """The offloaded V pool does not fit in the host memory that is available."""


def host_memory_available() -> int:
    """Bytes of host memory that new allocations can take: MemAvailable on Linux, else free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def pinned_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised page-locked host tensor of exactly its size, mapped into the GPU's address space
    (Triton looks up the device address of each pointer it is given, so kernels take the tensor as it is).

    ``torch.empty(..., pin_memory=True)`` goes through torch's caching host allocator, which rounds
    every allocation up to a power of two: a pool of 32.1 GiB would pin 64 GiB. So this pins an
    ordinary allocation with ``cudaHostRegister`` and unregisters it when the tensor is collected, once
    the GPU has finished what was queued (kernels read and write it in place).
    """
    t = torch.empty(shape, dtype=dtype)
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(t.data_ptr(), t.nbytes, CUDA_HOST_REGISTER_MAPPED))
    if err:
        raise HostMemoryError(f"could not pin {t.nbytes / 2**30:.1f} GiB of host memory (cudaError {err})")
    weakref.finalize(t, _unpin, t.data_ptr())
    return t


def _unpin(address: int) -> None:
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaHostUnregister(address)


class KVCache:
    def __init__(self, n_layers: int, n_slots: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, offload: str = "none",
                 select_dtype: torch.dtype | None = None, kept_rows: int = KEPT_ROWS):
        """offload: "none" (K and V on ``device``) or "values" (V in host memory, see the module; ``kept_rows``
        staged rows a layer stay on the device). select_dtype: None, or the dtype of the selection keys' own copy
        (see the module)."""
        if offload not in OFFLOAD_MODES:
            raise ValueError(f"kv_offload must be one of {', '.join(OFFLOAD_MODES)}, not {offload!r}")
        shape = (n_layers, n_slots, n_kv_heads, head_dim)
        self.offload = offload
        self.k = torch.empty(shape, dtype=dtype, device=device)
        self.k_select = (self.k if select_dtype in (None, dtype)
                         else torch.empty(shape, dtype=select_dtype, device=device))  # [n_layers, n_slots, n_kv, d]
        if offload == "values":
            self.v = self._host_pool(shape, dtype)
            counts = torch.zeros(2, dtype=torch.int64, device=device)
            self.kept = [Kept.empty(kept_rows, self.v[i], device, counts) for i in range(n_layers)]
        else:
            self.v = torch.empty(shape, dtype=dtype, device=device)
        self.n_slots = n_slots
        self.arange = Aranges(self.k.device)  # index runs on the pool's device, without a kernel launch each
        # Free list as a stack: slots [0, _top) of _stack are free; allocation pops from the top.
        self._stack = torch.arange(n_slots - 1, -1, -1, dtype=torch.int64, device=device)
        self._top = n_slots

    def _host_pool(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The offloaded V pool: pinned and mapped when K is on a GPU. Raises HostMemoryError up front if the
        host has not got the memory (rather than letting the pinning fail or the OS kill the process)."""
        need, free = math.prod(shape) * dtype.itemsize, host_memory_available()
        if need > free:
            raise HostMemoryError(
                f"the offloaded V pool needs {need / 2**30:.1f} GiB of host memory for {shape[1]} tokens, but "
                f"{free / 2**30:.1f} GiB is available: lower kv_cache_tokens / --kv-cache-tokens")
        if self.k.device.type == "cuda":
            return pinned_empty(shape, dtype)
        return torch.empty(shape, dtype=dtype)

    @property
    def pools(self) -> list[torch.Tensor]:
        """Every pool a write stores into: K, V and the selection keys' copy if there is one."""
        return [self.k, self.v] + ([self.k_select] if self.k_select is not self.k else [])

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
        """Store un-rotated ``k, v: [n, n_kv_heads, head_dim]`` (each row contiguous: they may be slices of the
        q/k/v product's rows) at ``slots: [n]``, cast to the pool's dtype (e.g. fp8 storage), the keys also in
        the selection keys' copy if there is one; with value offload the values go straight to the host pool.
        One kernel on a GPU writes every pool (``kernels/row_copy.py``)."""
        pairs = [(k.to(self.k.dtype), self.k[layer]), (v.to(self.v.dtype), self.v[layer])]
        if self.k_select is not self.k:
            pairs.append((k.to(self.k_select.dtype), self.k_select[layer]))
        # values kept on the device for these slots are not theirs any more (``stage``)
        forget = self.kept[layer].row_of if self.offload == "values" else None
        (scatter_rows if slots.is_cuda else scatter_rows_ref)(pairs, slots, forget)

    def rows(self, slots: torch.Tensor) -> list[torch.Tensor]:
        """Copies of ``slots: [n]``'s rows in every pool and layer, as bytes (``[n_layers, n, n_kv_heads, head_dim *
        itemsize]`` uint8 a pool, on that pool's device): what ``put_rows`` writes back."""
        return [pool.view(torch.uint8)[:, slots.to(pool.device)].clone() for pool in self.pools]

    def put_rows(self, slots: torch.Tensor, rows: list[torch.Tensor]) -> None:
        """Write back the rows ``rows(slots)`` took (undoing the writes since). As a write does, this forgets the
        values kept on the device for these slots: a row staged after the writes it undoes holds their values."""
        for pool, saved in zip(self.pools, rows):
            pool.view(torch.uint8)[:, slots.to(pool.device)] = saved
        if self.offload == "values":
            for kept in self.kept:
                kept.row_of[slots] = -1

    def stage(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """With value offload: the K and V rows of ``slots: [n]`` (on the device) as new device tensors
        ``[n, n_kv_heads, head_dim]`` in the pools' dtype, i.e. pools that attention reads at slots
        ``arange(n)``. A V row the layer's last staging kept is copied on the device, the others cross the bus
        once; the host takes no part."""
        gather, stage = (gather_rows, stage_rows) if slots.is_cuda else (gather_rows_ref, stage_rows_ref)
        with torch.profiler.record_function("kv_cache.stage"):
            return gather(self.k[layer], slots), stage(self.v[layer], slots, self.kept[layer])

    def kept_counts(self) -> tuple[int, int]:
        """With value offload: (V rows staged, of them found kept on the device) since the cache was made."""
        return tuple(self.kept[0].counts.tolist())

    def attention_pools(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What attention reads for the attended ``slots`` ([n], or [B, n] for a batch): (K pool, V pool, slots to
        read them at). The layer's pools at ``slots`` themselves, or with value offload the rows staged on the
        device (``stage``) at 0..n-1 (0..B n - 1, in the slots' shape)."""
        if self.offload != "values":
            return self.k[layer], self.v[layer], slots
        k, v = self.stage(layer, slots.reshape(-1))
        return k, v, self.arange(slots.numel()).view(slots.shape)

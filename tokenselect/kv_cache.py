"""Paged KV cache with a page size of one token.

One pool of token slots serves every sequence and every layer: ``k[layer]: [n_slots, n_kv_heads,
head_dim]``. Keys are stored *before* RoPE, so any attention policy can rotate them at whatever
positions it chooses. A sequence owns an ordered list of slots (its slot table, in the engine);
the allocator hands out and takes back slots through a free list.

Value offload (``offload="values"``) keeps the V pool in host memory (page-locked when the device
is a GPU) and only K on the device: selection reads every key, but attention needs the values of
the attended slots alone, so ``stage`` copies just those rows to the device for each chunk and
layer. Policies read ``k`` only, never ``v``. The values of a ``write`` reach the host pool at the
next ``stage`` (or ``flush``), which waits for the device anyway, so writing never blocks the host.
"""

from __future__ import annotations

import math
import os
import weakref

import torch

from .errors import KVPoolFull

OFFLOAD_MODES = ("none", "values")


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
    """An uninitialised page-locked host tensor of exactly its size.

    ``torch.empty(..., pin_memory=True)`` goes through torch's caching host allocator, which rounds
    every allocation up to a power of two: a pool of 32.1 GiB would pin 64 GiB. So this pins an
    ordinary allocation with ``cudaHostRegister`` and unregisters it when the tensor is collected.
    """
    t = torch.empty(shape, dtype=dtype)
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(t.data_ptr(), t.nbytes, 0))
    if err:
        raise HostMemoryError(f"could not pin {t.nbytes / 2**30:.1f} GiB of host memory (cudaError {err})")
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return t


def take_rows(pool: torch.Tensor, index: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``pool[index]`` along dim 0, copied as raw bytes (index_select has no fp8 kernel in every build).

    pool: [S, *row] contiguous; index: [n] int64 on pool's device; out: [n, *row] of pool's dtype,
    or None for a new tensor. Returns [n, *row] in pool's dtype.
    """
    raw = torch.index_select(pool.view(torch.uint8), 0, index, out=None if out is None else out.view(torch.uint8))
    return raw.view(pool.dtype)


class KVCache:
    def __init__(self, n_layers: int, n_slots: int, n_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, offload: str = "none"):
        """offload: "none" (K and V on ``device``) or "values" (V in host memory, see the module)."""
        if offload not in OFFLOAD_MODES:
            raise ValueError(f"kv_offload must be one of {', '.join(OFFLOAD_MODES)}, not {offload!r}")
        shape = (n_layers, n_slots, n_kv_heads, head_dim)
        self.offload = offload
        self.k = torch.empty(shape, dtype=dtype, device=device)
        if offload == "values":
            self.v = self._host_pool(shape, dtype)
        else:
            self.v = torch.empty(shape, dtype=dtype, device=device)
        self.n_slots = n_slots
        # Free list as a stack: slots [0, _top) of _stack are free; allocation pops from the top.
        self._stack = torch.arange(n_slots - 1, -1, -1, dtype=torch.int64, device=device)
        self._top = n_slots
        # Value offload: the last write's (layer, slots, values) still on the device; a host buffer
        # that V rows are gathered into before their copy to the device, and the event of the last
        # such copy (the buffer is reused only once it has completed).
        self._unflushed: tuple[int, torch.Tensor, torch.Tensor] | None = None
        self._staging: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None

    def _host_pool(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The offloaded V pool: pinned when K is on a GPU. Raises HostMemoryError up front if the host
        has not got the memory (rather than letting the pinning fail or the OS kill the process)."""
        need, free = math.prod(shape) * dtype.itemsize, host_memory_available()
        if need > free:
            raise HostMemoryError(
                f"the offloaded V pool needs {need / 2**30:.1f} GiB of host memory for {shape[1]} tokens, but "
                f"{free / 2**30:.1f} GiB is available: lower kv_cache_tokens / --kv-cache-tokens")
        if self.k.device.type == "cuda":
            return pinned_empty(shape, dtype)
        return torch.empty(shape, dtype=dtype)

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
        dtype, e.g. fp8 storage). With value offload, V reaches the host pool at the next stage/flush."""
        self.k[layer, slots] = k.to(self.k.dtype)
        if self.offload == "values":
            self.flush()
            self._unflushed = (layer, slots, v.to(self.v.dtype))
        else:
            self.v[layer, slots] = v.to(self.v.dtype)

    def flush(self) -> None:
        """Value offload: copy the values of the last write into the host pool (waits for the device)."""
        if self._unflushed is not None:
            layer, slots, v = self._unflushed
            self._unflushed = None
            self.v[layer, slots.cpu()] = v.cpu()

    def stage(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """With value offload: the K and V rows of ``slots: [n]`` (on the device) as new device
        tensors ``[n, n_kv_heads, head_dim]`` in the pool's dtype, i.e. pools that attention reads
        at slots ``arange(n)``. K is gathered on the device; V rows are gathered on the host into the
        (pinned) staging buffer, then copied over without blocking the host."""
        with torch.profiler.record_function("kv_cache.stage"):
            k = take_rows(self.k[layer], slots)
            host_slots = slots.cpu()  # waits for the policy's plan
            self.flush()  # the chunk's own values, among others, must be in the host pool
            if self._copied is not None:
                self._copied.synchronize()  # the staging buffer's last copy to the device is done
            staged = take_rows(self.v[layer], host_slots, out=self._staging_rows(host_slots.numel()))
            v = staged.to(self.k.device, non_blocking=True, copy=True)
            if self.k.device.type == "cuda":
                self._copied = torch.cuda.Event()
                self._copied.record()
            return k, v

    def _staging_rows(self, n: int) -> torch.Tensor:
        """[n, n_kv_heads, head_dim] at the start of the host staging buffer, which grows to the next
        power of two of rows when too small (pinned when the device is a GPU)."""
        if self._staging is None or self._staging.shape[0] < n:
            rows = 1 << max(n - 1, 0).bit_length()
            self._staging = torch.empty((rows, *self.v.shape[2:]), dtype=self.v.dtype,
                                        pin_memory=self.k.device.type == "cuda")
        return self._staging[:n]

"""Small int64 index tensors on the device without making the host wait or launching a kernel:
``to_device`` copies host values without a wait, ``Aranges`` hands out index runs of one kept arange."""

from __future__ import annotations

import torch


def to_device(values: list | list[list], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A tensor of ``values`` (int64, or ``dtype``) on ``device``.

    ``torch.tensor(values, device="cuda")`` copies from pageable host memory and then waits until the
    stream has run everything queued before the copy. This copies from page-locked memory without
    waiting, so the host can queue a step's work while the device still runs the previous step's (the
    page-locked block is reused only once its copy is done: torch's host allocator records it)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


class Aranges:
    """0, 1, ..., n - 1 (int64) on one device: read-only views of one arange, so that index runs and positions
    take no kernel launch each (``KVCache.arange``). A grown arange replaces a shorter one, which stays
    allocated: a recorded CUDA graph holds the address of what it read."""

    def __init__(self, device: torch.device):
        self.device = device
        self.kept: list[torch.Tensor] = []  # every arange grown, the longest last

    def __call__(self, n: int) -> torch.Tensor:
        if not self.kept or self.kept[-1].numel() < n:
            self.kept.append(torch.arange(max(n, 2 * self.kept[-1].numel() if self.kept else 0, 4096),
                                          device=self.device))
        return self.kept[-1][:n]

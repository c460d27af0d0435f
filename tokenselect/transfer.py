"""Small int64 index tensors on the device without making the host wait or launching a kernel:
``to_device`` copies host values without a wait, ``arange`` hands out index runs kept per device."""

from __future__ import annotations

import torch


def to_device(values: list[int] | list[list[int]], device: torch.device) -> torch.Tensor:
    """int64 tensor of ``values`` on ``device``.

    ``torch.tensor(values, device="cuda")`` copies from pageable host memory and then waits until the
    stream has run everything queued before the copy. This copies from page-locked memory without
    waiting, so the host can queue a step's work while the device still runs the previous step's (the
    page-locked block is reused only once its copy is done: torch's host allocator records it)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


_ARANGES: dict[torch.device, list[torch.Tensor]] = {}  # per device, every arange grown, the longest last


def arange(n: int, device: torch.device) -> torch.Tensor:
    """0, 1, ..., n - 1 (int64) on ``device``: a read-only view of an arange kept per device, so that
    plans take their index runs and positions without a kernel launch each. One that has to grow is
    replaced by a longer one but kept: a recorded CUDA graph holds the address of what it read."""
    grown = _ARANGES.setdefault(device, [])
    if not grown or grown[-1].numel() < n:
        grown.append(torch.arange(max(n, 2 * grown[-1].numel() if grown else 0, 4096), device=device))
    return grown[-1][:n]

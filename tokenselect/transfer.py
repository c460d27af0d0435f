"""Host-to-device copies that do not make the host wait for the device."""

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

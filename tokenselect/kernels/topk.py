"""Top-k over the vote. torch.topk (radix select on the GPU) is not the bottleneck next to the
vote itself, which reads every key once: ``tokenselect bench attention`` times both."""

from __future__ import annotations

import torch


def topk_ref(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores: [N] -> indices [min(k, N)] int64 of the largest scores (any order)."""
    return torch.topk(scores, min(k, scores.numel()), sorted=False).indices

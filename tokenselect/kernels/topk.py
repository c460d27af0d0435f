"""Top-k over the vote. On the GPU, torch.topk (a radix select) is used for both kernel sets:
``tokenselect bench attention`` times it beside the vote, which has to read every key and so
costs several times more at every length measured."""

from __future__ import annotations

import torch


def topk_ref(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores: [N] -> indices [min(k, N)] int64 of the largest scores (any order)."""
    return torch.topk(scores, min(k, scores.numel()), sorted=False).indices

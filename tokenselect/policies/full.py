"""Full attention: every cached token at its original position (dense baseline)."""

from __future__ import annotations

import torch

from .base import AttentionPolicy, Plan, SeqView, contiguous_plan


class FullAttention(AttentionPolicy):
    name = "full"

    def plan(self, layer: int, seq: SeqView, q: torch.Tensor) -> Plan:
        return contiguous_plan(seq, q.shape[0])

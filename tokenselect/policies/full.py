"""Full attention: every cached token at its original position (dense baseline)."""

from __future__ import annotations

import torch

from ..transfer import arange
from .base import AttentionPolicy, GraphList, GraphSeq, Plan, SeqView, contiguous_plan


class FullAttention(AttentionPolicy):
    name = "full"

    def plan(self, layer: int, seq: SeqView, q: torch.Tensor) -> Plan:
        return contiguous_plan(seq, q.shape[0])

    def graph_ready(self, t: int, c: int = 1) -> bool:
        """From the first token on; not with the values on the host, where a graph would stage the table's
        whole capacity (up to GRAIN - 1 rows more than the context, the whole prompt for every prefill chunk)."""
        return self.cache.offload != "values"

    def graph_list(self, layer: int, seq: GraphSeq, q: torch.Tensor, own: torch.Tensor) -> GraphList:
        """The sequence's table itself, at the original positions: its first length + w entries (the
        cached tokens, then the step's own, which ``own`` holds too) are attended, the rest of its fixed
        span is not read. The queries' positions and the live length depend on the step alone: computed once
        for all layers."""
        positions = arange(seq.table.numel(), q.device)
        w = own.numel()
        q_pos = seq.once(f"length + first {w}", lambda: seq.length + positions[:w])
        return GraphList(seq.table, positions, q_pos, seq.once(f"length + {w}", lambda: seq.length + w))

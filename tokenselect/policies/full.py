"""Full attention: every cached token at its original position (dense baseline)."""

from __future__ import annotations

import torch

from .base import Attended, AttentionPolicy, SeqStep


class FullAttention(AttentionPolicy):
    name = "full"
    prefix_reuse = "token"
    generated_reuse = True  # every query row attends every token before it, in decode as in prefill

    def attend(self, layer: int, step: SeqStep, q: torch.Tensor, own: torch.Tensor) -> Attended:
        return self.whole_table(step, own.numel())

    def attend_batch(self, layer: int, steps: list[SeqStep], q: torch.Tensor, own: torch.Tensor) -> list[Attended]:
        """Their positions and lengths as rows of one tensor a step (``whole_tables``)."""
        return self.whole_tables(steps, own.shape[1])

    def graph_ready(self, t: int, w: int = 1) -> bool:
        """From the first token on; not with the values on the host, where a graph would stage the table's
        whole capacity (up to GRAIN - 1 rows more than the context, the whole prompt for every prefill chunk)."""
        return self.cache.offload != "values"

"""StreamingLLM: attention sinks plus a sliding window (Xiao et al., 2023, "Efficient Streaming
Language Models with Attention Sinks").

Every chunk attends the first ``n_init`` tokens (the sinks) and the ``n_local`` most recent ones;
nothing is chosen from the middle. Positions are re-indexed inside that cache, as StreamingLLM does
(sinks at 0..n_init-1, the window right after them), so they never exceed n_init + n_local + chunk.
Defaults follow the TokenSelect paper's baseline setup: 128 sinks (StreamingLLM itself uses 4) and
a 4096-token window.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..kernels import Kernels
from ..kv_cache import KVCache
from ..settings import Validated
from .base import SelectivePolicy, SeqStep, dense_until_setting, n_init_setting, n_local_setting, positions_setting


@dataclass(frozen=True)
class StreamingSettings(Validated):
    n_init: int = n_init_setting(128)
    n_local: int = n_local_setting(4096)
    positions: str = positions_setting()
    dense_until: int | None = dense_until_setting()


class StreamingLLM(SelectivePolicy):
    name = "streaming"
    Settings = StreamingSettings

    def __init__(self, cache: KVCache, kernels: Kernels, **settings):
        s = self.Settings(**settings)
        super().__init__(cache, kernels, n_init=s.n_init, n_local=s.n_local, budget=0, positions=s.positions,
                         dense_until=s.dense_until)

    def choose(self, layer: int, step: SeqStep, q: torch.Tensor) -> tuple[torch.Tensor, None]:
        """The middle is evicted: nothing is chosen from it."""
        return step.table.new_zeros(0), None

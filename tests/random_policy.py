"""A toy policy, as a newcomer would add one: attend the sinks, k random middle tokens and the local window.

Adding it takes this file (the policy and its settings) and one line in the registry (``policies.POLICIES``;
the test adds it there).
``choose`` is tensor operations on the device with shapes fixed by the step, so the same code runs eagerly
and inside a CUDA graph. The randomness is a hash of (token, length, layer) rather than a generator's draw,
so that the run a graph is checked against and its replay choose alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenselect.policies import SelectivePolicy, SeqStep
from tokenselect.policies.base import n_init_setting, n_local_setting
from tokenselect.settings import Validated, setting


@dataclass(frozen=True)
class RandomKSettings(Validated):
    k: int = setting(8, "random middle tokens attended", unit="tokens", low=0)
    n_init: int = n_init_setting(4)
    n_local: int = n_local_setting(16)


class RandomK(SelectivePolicy):
    name = "random"
    Settings = RandomKSettings

    def __init__(self, cache, kernels, **settings):
        s = self.Settings(**settings)
        super().__init__(cache, kernels, n_init=s.n_init, n_local=s.n_local, budget=s.k)
        self.k = s.k

    def choose(self, layer: int, step: SeqStep, q: torch.Tensor) -> tuple[torch.Tensor, None]:
        middle, live = self.middle(step)  # candidates: middle[:live]
        noise = torch.sin((self.cache.arange(middle.numel()) + 1) * 12.9898 + step.length * 78.233 + layer)
        scores = (noise * 43758.5453).frac().abs().float()
        return self.kernels.topk(scores, self.k, live), None  # k indices into the middle, ascending

"""Adding a policy: one file (``random_policy.py``) and one registry line, and it runs in the engine eagerly and
through the whole-step graphs (recorded and replayed on a GPU, the same step function run eagerly on a CPU)."""

from __future__ import annotations

import pytest
import torch

from tokenselect import LLM, SamplingParams
from tokenselect.policies import POLICIES

from random_policy import RandomK


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_a_toy_policy_runs_eagerly_and_in_whole_step_graphs(tiny_llama, monkeypatch, cuda_graphs):
    monkeypatch.setitem(POLICIES, RandomK.name, RandomK)  # the registry line
    llm = LLM(tiny_llama, "random", chunk_size=32, cuda_graphs=cuda_graphs, k=16, n_init=4, n_local=16)
    seen = []
    attend = llm.policy.attend
    llm.policy.attend = lambda *a: seen.append(attend(*a)) or seen[-1]
    prompt = torch.randint(2, 300, (300,), generator=torch.Generator().manual_seed(3)).tolist()
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert len(out[0].token_ids) == 6
    last = seen[-1]  # the last decode step: 4 sinks, 16 chosen, the 16 most recent, its own token
    assert last.slots.numel() == 4 + 16 + 16 + 1 and last.key_pos.tolist() == list(range(37))
    if cuda_graphs:
        assert llm.runner.graphs.whole_steps >= 5 and llm.runner.graphs.failure is None
    assert llm.scheduler.available == llm.cache.n_slots  # every slot free or held by the prefix cache

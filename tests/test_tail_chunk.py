"""EngineSettings.tail_chunk: the prompt's last N tokens run as a prefill chunk of their own."""

from __future__ import annotations

import pytest
import torch

from tokenselect import LLM, SamplingParams


def chunks_of(llm: LLM, prompt: list[int]) -> tuple[list[int], list[int]]:
    """(the prefill chunk sizes the scheduler gave the prompt, the greedy tokens)."""
    sizes, schedule = [], llm.scheduler.schedule

    def recording():
        batch = schedule()
        sizes.extend(n for seq, n in batch if seq.prefilling)
        return batch

    llm.scheduler.schedule = recording
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0].token_ids
    llm.scheduler.schedule = schedule
    return sizes, out


PROMPT = torch.randint(2, 300, (1000,), generator=torch.Generator().manual_seed(5)).tolist()


@pytest.mark.parametrize("tail, sizes", [
    (0, [256, 256, 256, 232]),
    (40, [256, 256, 256, 192, 40]),  # the boundary before the tail is the only new one
    (232, [256, 256, 256, 232]),  # the tail is exactly the last chunk: nothing changes
    (256, [256, 256, 232, 256]),  # a tail as long as a chunk, starting inside one
    (1, [256, 256, 256, 231, 1]),
])
def test_the_tail_runs_as_a_chunk_of_its_own_and_full_attention_is_unchanged(tiny_llama, tail, sizes):
    llm = LLM(tiny_llama, "full", chunk_size=256, tail_chunk=tail, prefix_cache=False)
    got, tokens = chunks_of(llm, PROMPT)
    assert got == sizes and sum(got) == len(PROMPT)
    _, plain = chunks_of(LLM(tiny_llama, "full", chunk_size=256, prefix_cache=False), PROMPT)
    assert tokens == plain  # full attention computes each query row alone: where the chunks end does not matter


def test_the_tail_chunk_chooses_with_its_own_queries(tiny_llama):
    """TokenSelect selecting from the start: the last prefill step has the tail's 40 queries, and what it attends
    differs from what the 232-token last chunk attends without the setting."""
    seen = {}
    for tail in (0, 40):
        llm = LLM(tiny_llama, "tokenselect", chunk_size=256, tail_chunk=tail, prefix_cache=False, dense_until=0,
                  k=32, n_init=4, n_local=16)
        steps, attend = [], llm.policy.attend
        llm.policy.attend = lambda layer, step, q, own: steps.append((layer, step.decode, q.shape[0],
                                                                     attend(layer, step, q, own))) or steps[-1][3]
        chunks_of(llm, PROMPT)
        last = [s for s in steps if not s[1] and s[0] == 0][-1]  # layer 0 of the last prefill step
        seen[tail] = last
    assert seen[0][2] == 232 and seen[40][2] == 40
    assert not torch.equal(seen[0][3].slots, seen[40][3].slots)


def test_a_tail_longer_than_the_chunk_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="tail_chunk"):
        LLM(tiny_llama, "full", chunk_size=256, tail_chunk=257)

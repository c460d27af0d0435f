"""TokenSelect's prefill_group: a prefill chunk longer than the group chooses for each group of its queries, as
chunks of the group's size would, the groups' choices made as a batch (one launch of each selection kernel, the
scores kernel reading the shared slot list once for all the groups)."""

from __future__ import annotations

import pytest
import torch

from tokenselect import LLM, SamplingParams
from tokenselect.policies.base import ALL, SELECT, SeqStep

from test_tail_chunk import chunks_of

SELECTING = dict(dense_until=0, k=32, n_init=4, n_local=16)  # selects from the prompt's 53rd token on
PROMPT = torch.randint(2, 300, (1100,), generator=torch.Generator().manual_seed(3)).tolist()


def logits(tiny_llama, chunk: int, cuda_graphs: bool = False, whole_steps: int = 0, **settings) -> torch.Tensor:
    """The prompt's logits through chunks of ``chunk``; ``whole_steps``: how many of them must run as whole steps."""
    llm = LLM(tiny_llama, "tokenselect", chunk_size=chunk, kernels="torch", cuda_graphs=cuda_graphs,
              prefix_cache=False, **SELECTING, **settings)
    out = llm.prompt_logits(PROMPT)
    assert (llm.runner.graphs.whole_steps if cuda_graphs else 0) == whole_steps
    return out


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_a_chunk_of_groups_chooses_as_chunks_of_the_group_would(tiny_llama, batch_invariant_matmuls, cuda_graphs):
    """1,100 tokens: 17 chunks of 64 (of 4 groups of 16) and a last one of 12 (a group shorter than 16), against
    chunks of 16. With cuda_graphs (on a CPU: the whole-step graph's step function, run eagerly), the 17 full chunks
    run as whole prefill steps. Without the groups the 64-token chunks choose otherwise."""
    want = logits(tiny_llama, 16)
    got = logits(tiny_llama, 64, prefill_group=16, cuda_graphs=cuda_graphs, whole_steps=17 if cuda_graphs else 0)
    # the rounding of the batched kernels' sums: measured 2e-6 of logits of norm ~1
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
    once = logits(tiny_llama, 64, prefill_group=0)
    assert (once - want).abs().max() > 1e-2


def test_the_groups_choose_as_chunks_would_with_the_triton_kernels(tiny_llama, batch_invariant_matmuls):
    """The same with the Triton kernels (in the interpreter): the folded scores kernel, the batched vote and top-k.
    A shorter prompt: 6 chunks of 64 and 40 tokens (two groups of 16 and one of 8)."""
    prompt = PROMPT[:424]
    kw = dict(prefix_cache=False, kernels="triton", cuda_graphs=False, **SELECTING)
    want = LLM(tiny_llama, "tokenselect", chunk_size=16, **kw).prompt_logits(prompt)
    got = LLM(tiny_llama, "tokenselect", chunk_size=64, prefill_group=16, **kw).prompt_logits(prompt)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def test_which_chunks_are_split_into_groups(tiny_llama):
    """A group as long as the chunk, or longer, or 0, leaves the chunk whole; a decode step and a chunk that attends
    every token are never split; the setting reaches the policy."""
    llm = LLM(tiny_llama, "tokenselect", chunk_size=64, prefix_cache=False, prefill_group=16, **SELECTING)
    policy = llm.policy
    assert policy.prefill_group == 16
    table = torch.arange(200)
    step = SeqStep(table, torch.tensor(100), torch.tensor(0), False, SELECT)
    g, groups = policy.query_groups(step, 40)
    assert g == 16 and [int(s.length) for s in groups] == [100, 116, 132]
    assert all(s.mode == SELECT and not s.decode and s.table is table for s in groups)
    assert policy.query_groups(step, 40) == (16, groups)  # made once a step, for every layer
    assert policy.query_groups(SeqStep(table, torch.tensor(100), torch.tensor(0), False, SELECT), 16) is None
    assert len(policy.query_groups(SeqStep(table, torch.tensor(100), torch.tensor(0), False, SELECT), 17)[1]) == 2
    assert policy.query_groups(SeqStep(table, torch.tensor(100), torch.tensor(0), False, ALL), 64) is None
    assert policy.query_groups(SeqStep(table, torch.tensor(100), torch.tensor(0), True, SELECT), 64) is None
    policy.prefill_group = 0
    assert policy.query_groups(SeqStep(table, torch.tensor(100), torch.tensor(0), False, SELECT), 64) is None


def test_a_negative_group_is_refused(tiny_llama):
    with pytest.raises(ValueError, match="prefill_group"):
        LLM(tiny_llama, "tokenselect", prefill_group=-1)


def test_groups_choose_alike_beside_other_sequences(tiny_llama, batch_invariant_matmuls):
    """Two prompts generated together (continuous batching: one decodes while the other's chunks prefill, in steps of
    both): in 64-token chunks of 16-query groups each gets the tokens that 16-token chunks give it."""
    prompts = [PROMPT[:700], PROMPT[300:1100]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def tokens(chunk: int, **settings) -> list[list[int]]:
        llm = LLM(tiny_llama, "tokenselect", chunk_size=chunk, kernels="torch", cuda_graphs=False, prefix_cache=False,
                  max_num_seqs=2, **SELECTING, **settings)
        return [out.token_ids for out in llm.generate(prompts, params, use_tqdm=False)]

    want = tokens(16)
    assert tokens(64, prefill_group=16) == want
    assert tokens(64, prefill_group=0) != want  # (the chunks choosing once answer otherwise)


def test_a_chunk_ends_where_its_groups_would_change_mode(tiny_llama, batch_invariant_matmuls, monkeypatch):
    """dense_until 100: 16-token chunks attend every token up to 96 and select from the chunk at 96 on (its end
    passes 100), so the 64-token chunk from 64 stops at 96 and the next runs to the chunk boundary at 128. Its groups
    then choose as 16-token chunks do; run whole, the chunk from 64 would select at 64 and 80 too."""
    settings = dict(SELECTING, dense_until=100)
    prompt = PROMPT[:300]
    kw = dict(kernels="torch", cuda_graphs=False, prefix_cache=False, **settings)
    grouped = LLM(tiny_llama, "tokenselect", chunk_size=64, prefill_group=16, **kw)
    assert chunks_of(grouped, prompt)[0] == [64, 32, 32, 64, 64, 44]
    assert [grouped.policy.prefill_cut(t, 64) for t in (0, 64, 96, 128)] == [64, 32, 64, 64]
    assert grouped.policy.prefill_cut(64, 16) == 16  # one group: nothing to cut
    want = LLM(tiny_llama, "tokenselect", chunk_size=16, **kw).prompt_logits(prompt)
    torch.testing.assert_close(grouped.prompt_logits(prompt), want, rtol=0, atol=1e-4)
    uncut = LLM(tiny_llama, "tokenselect", chunk_size=64, prefill_group=16, **kw)
    monkeypatch.setattr(uncut.policy, "prefill_cut", lambda t, n: n)
    assert (uncut.prompt_logits(prompt) - want).abs().max() > 1e-2


def test_a_prefix_reused_at_a_groups_start_answers_as_without_reuse(tiny_llama, batch_invariant_matmuls):
    """A second prompt sharing 440 tokens with the first reuses 432 of them (27 groups of 16; 6.75 chunks of 64) and
    answers as an engine without a prefix cache; chunks of 64 choosing once reuse only 384."""
    first = PROMPT[:500]
    second = PROMPT[:440] + PROMPT[600:660]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    kw = dict(kernels="torch", cuda_graphs=False, chunk_size=64, **SELECTING)
    want = LLM(tiny_llama, "tokenselect", prefix_cache=False, prefill_group=16, **kw).generate(
        [second], params, use_tqdm=False)[0].token_ids
    for group, reused in ((16, 432), (0, 384)):
        llm = LLM(tiny_llama, "tokenselect", prefix_cache=True, prefill_group=group, **kw)
        llm.generate([first], params, use_tqdm=False)
        out = llm.generate([second], params, use_tqdm=False)[0]
        assert out.cached_tokens == reused
        if group:
            assert out.token_ids == want

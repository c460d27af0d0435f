"""Decode through ``DecodeGraphs`` (the model split into pieces around attention, batches padded to a
bucket) computes what the plain forward computes. On a CPU the pieces run eagerly; the GPU run
(benchmarks/results) records them as CUDA graphs and checks the same equalities."""

from __future__ import annotations

import pytest
import torch

from tokenselect import LLM, SamplingParams
from tokenselect.bench.dense import DenseRunner
from tokenselect.decode_graphs import BUCKETS, DecodeGraphs


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Recorder:
    """An attention context that attends nothing but the token itself (out = v, repeated over the
    query heads of its group) and records the rows it was given."""

    def __init__(self, group: int):
        self.group, self.rows = group, []

    def attention(self, layer, q, k, v):
        self.rows.append((layer, q.shape[0]))
        return v.repeat_interleave(self.group, dim=1)


@pytest.mark.parametrize("n", [1, 3, 5])
def test_pieces_equal_the_forward_and_attention_sees_only_real_rows(tiny_llama, n):
    llm = LLM(tiny_llama, "full", dtype="float32", cuda_graphs=False)
    cfg = llm.config
    group = cfg.n_heads // cfg.n_kv_heads
    tokens = torch.tensor(ids(n, n), device=llm.device)
    want = llm.model(tokens, Recorder(group))
    ctx = Recorder(group)
    got = DecodeGraphs(llm.model, llm.device).run(tokens, ctx)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # a padded batch may round apart
    assert ctx.rows == [(layer, n) for layer in range(cfg.n_layers)]


def test_bucket_is_the_smallest_that_holds_the_batch():
    assert [DecodeGraphs.bucket(n) for n in (1, 2, 3, 5, 64)] == [1, 2, 4, 8, 64]
    assert DecodeGraphs.bucket(BUCKETS[-1] + 1) is None


@pytest.mark.parametrize("attention", ["full", "tokenselect"])
def test_engine_decodes_the_same_through_the_graph_pieces(tiny_llama, batch_invariant_matmuls, attention):
    """Three prompts (prefilled one after another, then decoding together: bucket 4, one padding row)
    give the tokens of the plain path; tokenselect with a small budget selects or reuses (Selection
    Cache) on every step."""
    settings = {"k": 16, "n_init": 4, "n_local": 16, "theta": 0.5} if attention == "tokenselect" else {}
    prompts = [ids(60, 1), ids(50, 2), ids(64, 3)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain = LLM(tiny_llama, attention, chunk_size=32, cuda_graphs=False, **settings)
    graphed = LLM(tiny_llama, attention, chunk_size=32, cuda_graphs=True, **settings)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in graphed.generate(prompts, params)] == want
    assert 4 in graphed.decode_graphs._buckets
    if attention == "tokenselect":
        assert graphed.stats()["selection_cache_hits"] > 0 and graphed.stats()["selection_cache_misses"] > 0
        assert graphed.stats()["selection_cache_hits"] == plain.stats()["selection_cache_hits"]


def test_dense_baseline_decodes_through_the_same_pieces(tiny_llama):
    llm = LLM(tiny_llama, "full", chunk_size=32, cuda_graphs=True)
    prompt = ids(90, 2)
    want = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].token_ids
    runner = DenseRunner(llm, 120)
    assert runner.graphs is llm.decode_graphs
    assert runner.generate(prompt, 32, 10) == want


def test_cuda_graphs_flag_reaches_the_engine():
    import argparse

    from tokenselect.policies import add_policy_args, policy_kwargs

    parser = argparse.ArgumentParser()
    add_policy_args(parser)
    assert policy_kwargs(parser.parse_args(["--no-cuda-graphs"]))["cuda_graphs"] is False
    assert "cuda_graphs" not in policy_kwargs(parser.parse_args([]))

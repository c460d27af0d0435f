"""Steps through the piecewise graphs (``GraphCache.run_layers``: the model split into pieces around attention, steps padded to a
captured size) compute what the plain forward computes. On a CPU the pieces run eagerly; on a GPU the
same tests record them as CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from tokenselect import LLM, SamplingParams
from tokenselect.bench.dense import DenseRunner
from tokenselect.cuda_graphs import DECODE_BUCKETS, GraphCache


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


@pytest.mark.parametrize("n", [1, 3, 5, 40])
def test_pieces_equal_the_forward_and_attention_sees_only_real_rows(tiny_llama, n):
    llm = LLM(tiny_llama, "full", dtype="float32", cuda_graphs=False)
    cfg = llm.config
    group = cfg.n_heads // cfg.n_kv_heads
    tokens = torch.tensor(ids(n, n), device=llm.device)
    want = llm.model(tokens, Recorder(group))
    ctx = Recorder(group)
    got = llm.model.logits(GraphCache(llm.model, llm.cache, llm.kernels, llm.rope, llm.device, chunk_size=48).run_layers(tokens, ctx))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)  # a padded batch may round apart
    assert ctx.rows == [(layer, n) for layer in range(cfg.n_layers)]


def test_a_step_runs_in_the_smallest_captured_size_that_holds_it(tiny_llama):
    llm = LLM(tiny_llama, "full")
    graphs = GraphCache(llm.model, llm.cache, llm.kernels, llm.rope, torch.device("cpu"), chunk_size=512)
    assert [graphs.bucket(n) for n in (1, 2, 3, 5, 64, 65, 512)] == [1, 2, 4, 8, 64, 512, 512]
    assert graphs.bucket(513) is None
    assert GraphCache(llm.model, llm.cache, llm.kernels, llm.rope, torch.device("cpu"), 0).bucket(DECODE_BUCKETS[-1] + 1) is None


@pytest.mark.parametrize("attention", ["quest", "tokenselect"])
def test_engine_generates_the_same_through_the_graph_pieces(tiny_llama, batch_invariant_matmuls, attention):
    """Three prompts (prefilled in chunks of 32, one after another, then decoding together) give the
    tokens of the plain path. QUEST with the values on the host, attending every token (never a whole step then:
    a graph would stage the table's whole capacity), decodes through the pieces in bucket 4 (one padding row);
    tokenselect with a small budget selects or reuses (Selection Cache) on every decode step, its decode steps
    captured whole (batch 3)."""
    settings = {"k": 16, "n_init": 4, "n_local": 16, "theta": 0.5, "dense_until": 0} if attention == "tokenselect" \
        else {"kv_offload": "values"}
    prompts = [ids(60, 1), ids(50, 2), ids(64, 3)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    plain = LLM(tiny_llama, attention, chunk_size=32, cuda_graphs=False, **settings)
    graphed = LLM(tiny_llama, attention, chunk_size=32, cuda_graphs=True, **settings)
    want = [o.token_ids for o in plain.generate(prompts, params)]
    assert [o.token_ids for o in graphed.generate(prompts, params)] == want
    assert ("layers", 32) in graphed.runner.graphs.graphs
    if attention == "quest":
        assert ("layers", 4) in graphed.runner.graphs.graphs and not graphed.runner.graphs.whole_keys()
    else:
        assert 3 in [key[1] for key in graphed.runner.graphs.whole_keys()]
        assert graphed.stats()["selection_cache_hits"] > 0 and graphed.stats()["selection_cache_misses"] > 0
        assert graphed.stats()["selection_cache_hits"] == plain.stats()["selection_cache_hits"]


def test_prompt_logits_through_the_graph_pieces_equal_the_plain_path(tiny_llama):
    """Every row's logits of a chunked prefill (full chunks of 32 and a ragged last one, padded)."""
    prompt = ids(150, 6)
    settings = dict(chunk_size=32, k=16, n_init=4, n_local=16, dtype="float32")  # fp32 on a GPU too
    plain = LLM(tiny_llama, "tokenselect", cuda_graphs=False, **settings)
    graphed = LLM(tiny_llama, "tokenselect", cuda_graphs=True, **settings)
    torch.testing.assert_close(graphed.prompt_logits(prompt), plain.prompt_logits(prompt), rtol=1e-4, atol=1e-4)
    assert ("layers", 32) in graphed.runner.graphs.graphs


def test_dense_baseline_runs_through_the_same_pieces(tiny_llama):
    llm = LLM(tiny_llama, "full", chunk_size=32, cuda_graphs=True)
    prompt = ids(90, 2)
    want = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].token_ids
    runner = DenseRunner(llm, 120)
    assert runner.runner is llm.runner
    assert runner.generate(prompt, 32, 10) == want


def test_cuda_graphs_flag_reaches_the_engine():
    import argparse

    from tokenselect.policies import add_policy_args, policy_kwargs

    parser = argparse.ArgumentParser()
    add_policy_args(parser)
    assert policy_kwargs(parser.parse_args(["--no-cuda-graphs"]))["cuda_graphs"] is False
    assert "cuda_graphs" not in policy_kwargs(parser.parse_args([]))

"""``bench throughput``: the batched dense baseline computes what one-sequence runners compute, the engine at a batch
of B gives dense's tokens, and the command reports what it measured and what did not fit."""

from __future__ import annotations

import argparse
import functools
import json

import pytest
import torch

from tokenselect import LLM
from tokenselect.bench import e2e, throughput
from tokenselect.bench.dense import DenseRunner

TINY = {**e2e.TINY, "num_hidden_layers": 2}


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, 8000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@functools.lru_cache(maxsize=1)
def short_prose() -> tuple[int, ...]:
    """The corpus's first pages as token ids: the command's prompts without tokenizing 4 MB of prose per test run."""
    from tokenselect.data import default_model_path, prose_text
    from tokenselect.models import load_tokenizer

    return tuple(load_tokenizer(default_model_path())(prose_text()[:20_000])["input_ids"])


def tiny_llm(**settings) -> LLM:
    return LLM.random(TINY, "full", device="cpu", dtype="float32", chunk_size=64, **settings)


def test_batched_dense_decode_gives_each_sequence_its_own_runners_logits():
    """Three sequences of different lengths in one cache, decoded together (and fewer of them as the bench drops
    them) give, row by row, the logits of three one-sequence runners fed the same tokens; the batched step goes
    through ``decode_attention`` (the flat cache rows and per-sequence key counts the flash call reads), the
    one-sequence runners through SDPA."""
    llm = tiny_llm(kv_cache_tokens=16)
    prompts = [ids(256, 1), ids(200, 2), ids(131, 3)]
    batched = DenseRunner(llm, 300, batch=3)
    singles = [DenseRunner(llm, 280) for _ in prompts]
    got = torch.stack([batched.prefill(p, 64, seq) for seq, p in enumerate(prompts)])
    want = torch.stack([runner.prefill(p, 64) for runner, p in zip(singles, prompts)])
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same prefill path
    tokens = want.argmax(-1)
    for n in (3, 3, 2, 2, 1):
        got = batched.decode(tokens[:n])
        want = torch.stack([singles[seq].forward(tokens[seq:seq + 1]) for seq in range(n)])
        # measured: at most 2.4e-7 apart (fp32 on a CPU), logits of magnitude ~1, two sequences' ~1.3 apart
        torch.testing.assert_close(got, want, rtol=0, atol=2e-6)
        if n > 1:
            assert (got[0] - want[1]).abs().max() > 0.1  # each row is its own sequence's
        tokens = want.argmax(-1)
    assert batched.lengths == [261, 204, 133] and [r.length for r in singles] == [261, 204, 133]


def test_batched_dense_decode_refuses_a_step_past_the_cache():
    llm = tiny_llm(kv_cache_tokens=16)
    runner = DenseRunner(llm, 10, batch=2)
    runner.prefill(ids(10, 1), 64, 0)
    with pytest.raises(ValueError, match="cache holds 2 of 10 tokens"):
        runner.decode(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="cache holds 2 of 10 tokens"):
        runner.decode(torch.tensor([1, 2, 3]))


def test_engine_full_attention_at_a_batch_gives_dense_tokens():
    """Through the bench's own loop (prefill every request, then decode at 3, 2 and 1 requests, dropping the last
    each time), the engine's full attention and the batched dense baseline pick the same greedy tokens, in fp32."""
    batches, steps = [3, 2, 1], 3
    max_tokens = throughput.new_tokens(batches, steps)
    prompts = [ids(160, 4), ids(120, 5), ids(70, 6)]
    llm = tiny_llm(kv_cache_tokens=3 * (160 + max_tokens), prefix_cache=False)
    engine = throughput.EngineBatch(llm, max_tokens)
    engine.prefill(prompts)
    engine_rows = list(throughput.time_batches(engine, batches, steps, llm.device, "full"))
    dense = throughput.DenseBatch(DenseRunner(llm, 160 + max_tokens, 3), 64)
    dense.prefill(prompts)
    dense_rows = list(throughput.time_batches(dense, batches, steps, llm.device, "dense"))
    # every sequence's first token, then (2 untimed + 3 timed) steps at each batch size it lived through
    assert throughput.UNTIMED_STEPS == 2 and [len(out) for out in dense.outputs()] == [16, 11, 6]
    assert engine.outputs() == dense.outputs()
    for rows in (engine_rows, dense_rows):
        assert [(r["batch"], r["tokens"], "error" in r) for r in rows] == [(3, 9, False), (2, 6, False), (1, 3, False)]
    assert not llm.scheduler.running[2:] and engine.seqs[2].finish_reason == "abort"


def test_engine_prefill_holds_each_sequence_until_every_prompt_is_in():
    """No request decodes while a later one prefills: each has exactly its first token when the last is in."""
    llm = tiny_llm(kv_cache_tokens=1000, prefix_cache=False)
    engine = throughput.EngineBatch(llm, 5)
    engine.prefill([ids(200, 7), ids(150, 8), ids(120, 9)])
    assert [len(out) for out in engine.outputs()] == [1, 1, 1]
    assert [s.n_cached for s in engine.seqs] == [200, 150, 120]
    assert len(llm.scheduler.running) == 3
    assert engine.step() == 3


def run_command(tmp_path, monkeypatch, *flags: str) -> dict:
    monkeypatch.setattr(e2e, "prose_ids", short_prose)
    parser = argparse.ArgumentParser()
    throughput.add_parser(parser.add_subparsers())
    args = parser.parse_args(["throughput", "--config", "tiny", "--layers", "2", "--length", "128", "--chunk-size",
                              "64", "--decode-steps", "2", "--device", "cpu", "--output", str(tmp_path), "--tag", "t",
                              *flags])
    assert args.func(args) == 0
    return json.loads((tmp_path / "throughput_t.json").read_text())


def test_bench_throughput_reports_what_fits_and_what_does_not(tmp_path, monkeypatch):
    """A KV budget of 300 tokens holds 2 requests of 128 + 13 tokens (1 + 3 batch sizes x (2 untimed + 2 timed
    steps)): batch 3 is a row that says so for every method,
    batch 2 (the largest that fits, not asked for) and 1 are measured, and each ratio is against the faster dense row
    of its batch size."""
    policies = "dense,full,tokenselect:theta=-1"
    result = run_command(tmp_path, monkeypatch, "--batch-sizes", "1,3", "--policies", policies,
                         "--kv-cache-tokens", "300")
    rows = result["rows"]
    assert result["length"] == 128 and result["kv_cache_tokens"] == 300
    assert sorted((r["batch"], r["policy"], "error" in r) for r in rows) == sorted(
        (b, p, b == 3) for b in (1, 2, 3) for p in policies.split(","))
    assert all(r["fit_batch"] == 2 for r in rows)
    assert {r["error"] for r in rows if "error" in r} == {
        "does not fit: a 300-token KV budget holds 2 requests of 141 tokens"}
    measured = [r for r in rows if "error" not in r]
    assert all(r["tokens"] == r["batch"] * 2 and r["tokens_s"] > 0 and r["ms_step"] > 0 for r in measured)
    assert all(r["prefill_s"] > 0 for r in measured)
    table = (tmp_path / "throughput_t.md").read_text()
    for r in measured:
        best = max((d for d in measured if d["batch"] == r["batch"] and d["policy"] in ("dense", "full")),
                   key=lambda d: d["tokens_s"])
        batch = "2 (largest that fits)" if r["batch"] == 2 else "1"
        assert (f"| {batch} | {r['policy']} | fp32 | {r['ms_step']:.2f} | {r['tokens_s']:.1f} | "
                f"{r['tokens_s'] / best['tokens_s']:.2f}x ({best['policy']}) |") in table
    assert table.count("does not fit") == 3 and "- tokenselect:theta=-1: 2 requests, held 2 (prefill" in table
    # the prefill times are set-up, at the run's chunk (--chunk-size 64 here), and the report says so
    assert "prompts in 64-token chunks, set up for the decode timing, not a prefill comparison" in table
    assert (tmp_path / "throughput_t.png").stat().st_size > 0


def test_bench_throughput_pays_a_selection_keys_copy_in_tokens(tmp_path, monkeypatch):
    """With an fp8 copy of the keys (--select-dtype fp8) the engine's methods get the bytes of the 300-token budget:
    fp32 K and V (8 bytes an element pair) plus the copy's 1 make 300 * 8 // 9 = 266 tokens, 1 request of 141
    tokens; dense keeps its 2. The engine's pool is built with those 266 slots (its peak memory is the budget's)."""
    rows = run_command(tmp_path, monkeypatch, "--batch-sizes", "1,2", "--policies", "dense,tokenselect:theta=-1",
                       "--kv-cache-tokens", "300", "--select-dtype", "fp8")["rows"]
    assert {(r["policy"], r["fit_batch"]) for r in rows} == {("dense", 2), ("tokenselect:theta=-1", 1)}
    (refused,) = [r for r in rows if "error" in r]
    assert refused["batch"] == 2 and refused["policy"] == "tokenselect:theta=-1"
    assert refused["error"] == "does not fit: a 266-token KV budget holds 1 requests of 141 tokens"
    assert refused["kv"] == "fp32, fp8 selection keys"


def test_bench_throughput_engine_pool_bounds_the_policies_batch(tmp_path, monkeypatch):
    """Without a budget the engine's own pool (here its CPU default) decides what fits: 3 requests of 128 tokens
    do; a policy alone (no dense in the run) has no ratio."""
    rows = run_command(tmp_path, monkeypatch, "--batch-sizes", "1,3", "--policies", "tokenselect")["rows"]
    assert [(r["batch"], r["policy"], "error" in r) for r in rows] == [(3, "tokenselect", False),
                                                                      (1, "tokenselect", False)]
    assert rows[0]["fit_batch"] > 3 and rows[0]["held"] == 3
    table = (tmp_path / "throughput_t.md").read_text()
    assert "| dense n/a |" in table and f"- tokenselect: {rows[0]['fit_batch']} requests, held 3 (" in table


def test_bench_throughput_refuses_an_unknown_policy(tmp_path, monkeypatch):
    with pytest.raises(SystemExit, match="unknown policy 'tokenselekt'"):
        run_command(tmp_path, monkeypatch, "--policies", "dense,tokenselekt")
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention's batched decode graph runs on CUDA")
def test_batched_flash_decode_graph_gives_the_reference_logits():
    """On CUDA in bf16 a batched decode step is one graph per batch size, flash attention reading each sequence's
    key count on the device: it gives the logits of the same runner's eager step with the reference attention."""
    llm = LLM.random(TINY, "full", device="cuda", dtype="bfloat16", chunk_size=64, kv_cache_tokens=16)
    graphed, plain = DenseRunner(llm, 400, batch=3), DenseRunner(llm, 400, batch=3)
    assert graphed.flash_decode
    plain.flash_decode = False
    prompts = [ids(300, 1), ids(200, 2), ids(131, 3)]
    for runner in (graphed, plain):
        tokens = torch.stack([runner.prefill(p, 64, seq) for seq, p in enumerate(prompts)]).argmax(-1)
    for n in (3, 3, 3, 2, 2, 1):
        want, got = plain.decode(tokens[:n]), graphed.decode(tokens[:n])
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.05)
        tokens = want.argmax(-1)
    assert set(graphed.decode_graphs) == {3, 2, 1} and graphed.lengths == plain.lengths == [306, 205, 134]


def test_bench_throughput_with_fp8_weights_runs_dense_and_the_engine_so(tmp_path, monkeypatch):
    from tokenselect.models.fp8 import Fp8Linear

    made, random = [], throughput.LLM.random

    def recorded(*args, **kwargs):
        made.append(random(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(throughput.LLM, "random", recorded)
    result = run_command(tmp_path, monkeypatch, "--batch-sizes", "1", "--policies", "dense,full", "--weight-dtype",
                         "fp8")
    assert {r["policy"] for r in result["rows"] if "error" not in r} == {"dense", "full"}
    assert len(made) == 2 and all(isinstance(llm.model.model.layers[0].mlp.down_proj, Fp8Linear) for llm in made)
    assert "fp8 weights" in (tmp_path / "throughput_t.md").read_text()

"""The end-to-end bench's baselines and floors: what a decode step must read (``bench/floors.py``), the ratios
against the fastest baseline of a run, the estimate at a given hit rate, and transformers' row on the same
weights (``bench/hf_dense.py``)."""

import argparse
import json
from types import SimpleNamespace

import pytest
import torch
from torch.autograd.profiler_util import FunctionEvent

from tokenselect import LLM
from tokenselect.bench import attention, e2e
from tokenselect.bench.dense import DenseRunner
from tokenselect.bench.floors import (OTHER, attention_tokens, copy_bandwidth, decode_floor, kernel_times,
                                      matmul_rate, prefill_flops, prefill_pairs, profile_parts, selects, weight_bytes)
from tokenselect.bench.hf_dense import measure_transformers, transformers_model
from tokenselect.policies.base import SELECT

LLAMA = e2e.LLAMA3_8B
TS = {"attention": "tokenselect", "window": 8192, "k": 2048, "n_init": 128, "n_local": 512, "dense_until": None}


def test_weight_bytes_are_the_parameters_a_token_reads():
    """Every parameter of the model but the input embedding (one row a token), in the model's dtype."""
    llm = LLM.random(e2e.TINY, "full", device="cpu", kv_cache_tokens=16)
    params = dict(llm.model.named_parameters())
    read = sum(p.numel() * p.element_size() for name, p in params.items() if "embed_tokens" not in name)
    assert weight_bytes(e2e.TINY, llm.dtype.itemsize) == read


def test_llama3_8b_dense_floor_at_128k_reads_its_whole_cache():
    """The issue's figures: 17.2 GB of K and V at 128K, about 15 GB of weights (the 16 GB less the embedding)."""
    floor = decode_floor(LLAMA, None, 131072, bandwidth=2.96e12)
    assert floor["attention"] == 32 * 131072 * 8 * 128 * 2 * 2 == 17_179_869_184
    assert floor["scoring"] == 0
    assert floor["weights"] == 2 * (32 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 4096 * 14336 * 3 + 4096 * 2)
                                    + 4096 + 128256 * 4096)
    assert floor["floor_ms"] == pytest.approx((floor["weights"] + floor["attention"]) / 2.96e12 * 1e3)
    assert 10.5 < floor["floor_ms"] < 11.5  # the "floor 11.2 ms" (with the 16 GB)


def test_tokenselect_floor_scores_the_middle_unless_it_hits():
    length, fixed = 131072, 128 + 512
    miss = decode_floor(LLAMA, TS, length, 1.0)
    # the middle: the cached tokens between the sinks and the window; the list: sinks, k, window and its own
    assert miss["scoring"] == 32 * (length - 1 - fixed) * 8 * 128 * 2
    assert miss["attention"] == 32 * (fixed + 2048 + 1) * 8 * 128 * 2 * 2
    assert decode_floor(LLAMA, TS, length, 1.0, hit_rate=1.0)["scoring"] == 0
    quarter = decode_floor(LLAMA, TS, length, 1.0, hit_rate=0.25)
    assert quarter["scoring"] == pytest.approx(0.75 * miss["scoring"], abs=1)
    assert quarter["attention"] == miss["attention"]
    fp8 = decode_floor(LLAMA, TS, length, 1.0, select_bytes=1)
    assert fp8["scoring"] * 2 == miss["scoring"] and fp8["attention"] == miss["attention"]
    eight = decode_floor(LLAMA, TS, length, 1.0, batch=8)  # the weights read once for the batch
    assert eight["weights"] == miss["weights"]
    assert (eight["scoring"], eight["attention"]) == (8 * miss["scoring"], 8 * miss["attention"])
    assert eight["total"] == miss["weights"] + 8 * (miss["scoring"] + miss["attention"])


def test_attention_tokens_at_the_thresholds():
    # dense_until (None: the window): attends everything up to it, selects one token past it
    assert attention_tokens(TS, 8192) == (8192, 0)
    assert attention_tokens(TS, 8193) == (128 + 2048 + 512 + 1, 8192 - 640)
    # dense_until 0: as soon as the context exceeds n_init + k + n_local (budget == context attends all)
    # (``mode``: t <= n_init + k + n_local tokens cached before the step, budget == context, attends all)
    paper = {**TS, "dense_until": 0}
    assert attention_tokens(paper, 2689) == (2689, 0)
    assert attention_tokens(paper, 2690) == (2689, 2689 - 640)
    streaming = {"attention": "streaming", "window": 8192, "n_init": 128, "n_local": 4096}
    assert attention_tokens(streaming, 1000) == (1000, 0)
    assert attention_tokens(streaming, 4225) == (4225, 0)  # 4224 cached: the list holds them all
    assert attention_tokens(streaming, 4226) == (4225, 0)
    assert attention_tokens(streaming, 100_000) == (4225, 0)
    infllm = {"attention": "infllm", "window": 8192, "n_init": 128, "n_local": 4096, "k": 4096, "block_size": 128,
              "repr_keys": 4}
    # 8447 cached: sinks, window, k and a remainder of 127 (``InfLLM``'s budget), every token
    assert attention_tokens(infllm, 8448) == (8448, 0)
    assert attention_tokens(infllm, 8449) == (8321, (8448 - 4224) // 128 * 4)  # its remainder not counted
    assert attention_tokens(infllm, 131072) == (8321, (131071 - 4224) // 128 * 4)
    # every selective policy's dense_until: streaming's default (the window), InfLLM's past its own budget
    assert attention_tokens({**streaming, "dense_until": None}, 8192) == (8192, 0)
    assert attention_tokens({**streaming, "dense_until": None}, 8193) == (4225, 0)
    assert attention_tokens({**infllm, "dense_until": 16384}, 16384) == (16384, 0)
    assert attention_tokens({**infllm, "dense_until": 16384}, 16385) == (8321, (16384 - 4224) // 128 * 4)
    assert attention_tokens({"attention": "full", "window": 8192}, 5) == (5, 0)
    assert attention_tokens({"attention": "quest", "window": 8192}, 5) is None
    assert decode_floor(LLAMA, {"attention": "reattention", "window": 8192}, 5, 1.0) is None


def test_prefill_pairs_of_full_attention_are_the_causal_triangle_whatever_the_chunk():
    for length, chunk in [(1, 512), (1000, 512), (1024, 512), (4097, 2048), (5000, 5000)]:
        assert prefill_pairs(None, length, chunk) == length * (length + 1) // 2
        assert prefill_pairs({"attention": "full", "window": 8192}, length, chunk) == length * (length + 1) // 2


def test_tokenselect_prefill_pairs_by_group_inside_and_past_the_window():
    """TokenSelect in 2048-token chunks of four 512-query groups: every token up to the window (8192, dense_until's
    default), then each group attends sinks + k + window and its own tokens up to each query."""
    settings = {**TS, "prefill_group": 512}
    triangle = 512 * 513 // 2
    assert prefill_pairs(settings, 8192, 2048) == 8192 * 8193 // 2
    # the group at 8192 is the first past the window: it selects
    assert prefill_pairs(settings, 8192 + 512, 2048) == 8192 * 8193 // 2 + 512 * 2688 + triangle
    tail = 188 * 2688 + 188 * 189 // 2  # a last group of 188 queries
    assert prefill_pairs(settings, 8192 + 700, 2048) == 8192 * 8193 // 2 + 512 * 2688 + triangle + tail
    length = 131072
    selecting = (length - 8192) // 512
    assert prefill_pairs(settings, length, 2048) == 8192 * 8193 // 2 + selecting * (512 * 2688 + triangle)
    # a chunk that chooses once (prefill_group 0, or not smaller than the chunk) is one group
    once = {**TS, "prefill_group": 0}
    assert prefill_pairs(once, 8192 + 2048, 2048) == 8192 * 8193 // 2 + 2048 * 2688 + 2048 * 2049 // 2
    assert prefill_pairs({**TS, "prefill_group": 2048}, 8192 + 2048, 2048) == prefill_pairs(once, 8192 + 2048, 2048)
    assert prefill_pairs({"attention": "quest", "window": 8192}, 100, 64) is None


@pytest.mark.parametrize("policy, settings", [
    ("tokenselect", {"k": 64, "n_init": 4, "n_local": 16, "prefill_group": 32}),
    ("tokenselect", {"k": 64, "n_init": 4, "n_local": 16, "dense_until": 0}),
    ("streaming", {"n_init": 4, "n_local": 60}),
    ("infllm", {"k": 64, "n_init": 4, "n_local": 32, "block_size": 16, "dense_until": 160}),
    ("full", {}),
])
def test_the_floors_select_where_the_engines_policies_do(policy, settings):
    """``floors.selects`` on the engine's fitted settings (``LLM.policy_config``) against the policy's own ``mode``
    at every step around the thresholds: the floor counts a step's list as the engine builds it."""
    llm = LLM.random(e2e.TINY, policy, device="cpu", kv_cache_tokens=16, **settings)
    config = llm.policy_config
    for t in range(0, 400):
        for w in (1, 7, 32, 64):
            assert selects(config, t, t + w) == (llm.policy.mode(t, w) == SELECT), (t, w)


def test_prefill_flops_count_every_matrix_for_each_token_and_the_head_once():
    llm = LLM.random(e2e.TINY, "full", device="cpu", kv_cache_tokens=16)
    matrices = sum(p.numel() for name, p in llm.model.named_parameters()
                   if p.dim() == 2 and "embed_tokens" not in name and "lm_head" not in name)
    head = e2e.TINY["hidden_size"] * e2e.TINY["vocab_size"]
    flops = prefill_flops(e2e.TINY, None, 1000, 256)
    assert flops["matmuls"] == 2 * (1000 * matrices + head)
    layers, heads, head_dim = 2, 4, 32
    assert flops["attention"] == 4 * head_dim * heads * layers * 1000 * 1001 // 2
    assert flops["total"] == flops["matmuls"] + flops["attention"]
    # Llama-3-8B at 128K, dense: 1.83 PFLOP of matrices, 4.5 of attention (2 * 128K^2 * 4096 * 32)
    dense = prefill_flops(LLAMA, None, 131072, 8192)
    assert dense["matmuls"] == pytest.approx(1.83e15, rel=0.01)
    assert dense["attention"] == pytest.approx(2 * 131072 ** 2 * 4096 * 32, rel=1e-4)


def test_matmul_rate_is_measured():
    assert matmul_rate(torch.device("cpu"), n=128, repeats=2) > 1e6


def test_copy_bandwidth_is_measured():
    assert copy_bandwidth(torch.device("cpu"), nbytes=1 << 20, repeats=2) > 1e6


def test_profile_parts_counts_kernels_once_against_their_floors():
    cuda = torch.autograd.DeviceType.CUDA
    events = [SimpleNamespace(key=k, device_type=d, self_device_time_total=us) for k, d, us in [
        ("nvjet_sm90_tst_128x8_64x12", cuda, 8000.0),  # a GEMM: the weights
        ("aten::mm", cuda, 8000.0),  # the operator that launched it: not counted again
        ("_scores_kernel", cuda, 2000.0),
        ("_sparse_attention_kernel", cuda, 400.0),
        ("_histogram_kernel", cuda, 200.0),
        ("Memcpy DtoD (Device -> Device)", cuda, 100.0),
        ("cudaGraphLaunch", torch.autograd.DeviceType.CPU, 5000.0),
    ]]
    floor = {"weights": 3e9, "scoring": 1e9, "attention": 0.0, "floor_ms": 4.0}
    text = profile_parts(events, steps=2, floor=floor, bandwidth=1e12)
    assert "| weights | 4.000 | 3.000 | 75% |" in text
    assert "| scoring | 1.000 | 1.000 | 100% |" in text
    assert "| attention | 0.200 | - | - |" in text  # no floor given for it
    assert "| vote and top-k | 0.100 | - | - |" in text
    assert f"| {OTHER} | 0.050 | - | - |" in text
    assert "| all kernels | 5.350 | 4.000 | 75% |" in text


def _row(policy, prefill, decode, **more):
    return {"length": 131072, "policy": policy, "kv": "bf16", "prefill_s": prefill, "decode_ms": decode,
            "hit_rate": None, "peak_gb": 1.0, **more}


def test_ratios_are_against_the_fastest_baseline_of_each_phase():
    rows = [_row("dense", 10.0, 5.0), _row("dense:chunk=all", 6.0, 6.0), _row("transformers", 7.0, 20.0),
            _row("dense:chunk=8192", 1.0, 1.0, error="does not fit"),
            _row("tokenselect", 2.0, 4.0, hit_rate=0.0, prefill_floor_s=1.5, floor_ms=3.0)]
    best = e2e.best_dense(rows)[131072]
    assert best["prefill"]["policy"] == "dense:chunk=all" and best["decode"]["policy"] == "dense"
    table = e2e.table(rows)
    assert "| 128K | tokenselect | bf16 | 2.00 | 3.00x | 1.50 | 75% | 4.00 | 1.25x | 3.00 | 75% |" in table
    assert "| 128K | transformers | bf16 | 7.00 | 0.86x | - | - | 20.00 | 0.25x |" in table
    assert "x at 128K: prefill against dense:chunk=all (6.00 s), decode against dense (5.00 ms)" in table


def test_the_engines_full_attention_is_a_dense_row_the_ratios_take_where_fastest():
    """Full attention in the engine attends every token, as the baselines do: where its whole-step graphs decode
    faster than the dense baseline it is the decode reference (a tie keeps the first row); a selective policy or an
    estimate never is."""
    rows = [_row("dense", 10.0, 5.0), _row("full", 12.0, 4.0), _row("dense:chunk=all", 11.0, 4.0),
            _row("streaming", 1.0, 1.0), _row("tokenselect", 2.0, 2.0, hit_rate=0.0),
            _row("tokenselect at 27% hits (estimate)", 0.5, 0.5, estimated=True, hit_rate=0.27)]
    best = e2e.best_dense(rows)[131072]
    assert best["prefill"]["policy"] == "dense" and best["decode"]["policy"] == "full"
    assert "| 128K | tokenselect | bf16 | 2.00 | 5.00x | - | - | 2.00 | 2.00x |" in e2e.table(rows)


def test_a_merge_adds_estimates_at_another_hit_rate_beside_the_runs_own(tmp_path):
    """``bench e2e --merge FILE --hit-rate R``: rows estimated at R from the merged runs' measured rows (not from an
    estimate), beside the estimate the run wrote, or in its place at the run's own rate; a rate outside [0, 1] is
    refused before anything is read."""
    measured = [_row("tokenselect", 2.0, 10.0, hit_rate=0.0), _row("tokenselect:theta=-1", 2.1, 6.0, hit_rate=1.0)]
    (tmp_path / "run.json").write_text(json.dumps({"device": "GPU", "config": "llama3-8b",
                                                   "rows": measured + e2e.estimated_rows(measured, 0.25)}))
    parser = argparse.ArgumentParser()
    e2e.add_parser(parser.add_subparsers())
    merge = ["e2e", "--merge", str(tmp_path / "run.json"), "--output", str(tmp_path), "--tag", "m"]
    args = parser.parse_args([*merge, "--hit-rate", "0.5"])
    assert args.func(args) == 0
    rows = json.loads((tmp_path / "e2e_m.json").read_text())["rows"]
    estimates = {r["policy"]: r["decode_ms"] for r in rows if r.get("estimated")}
    assert estimates == {"tokenselect at 25% hits (estimate)": pytest.approx(9.0),
                         "tokenselect at 50% hits (estimate)": pytest.approx(8.0)}
    args = parser.parse_args([*merge, "--hit-rate", "0.25", "--tag", "same"])  # the run's own rate: one row of it
    assert args.func(args) == 0
    rows = json.loads((tmp_path / "e2e_same.json").read_text())["rows"]
    assert [r["policy"] for r in rows if r.get("estimated")] == ["tokenselect at 25% hits (estimate)"]
    with pytest.raises(SystemExit, match="--hit-rate must be between 0 and 1, not 1.5"):
        args = parser.parse_args([*merge, "--hit-rate", "1.5", "--tag", "bad"])
        args.func(args)
    assert not (tmp_path / "e2e_bad.json").exists()


def test_estimate_at_a_hit_rate_mixes_the_selecting_and_hit_rows():
    rows = [_row("tokenselect", 2.0, 10.0, hit_rate=0.0, floor_ms=8.0),
            _row("tokenselect:theta=-1", 2.1, 6.0, hit_rate=1.0, floor_ms=5.0),
            _row("tokenselect:theta=-1", 2.1, 6.0, hit_rate=1.0, kv="fp8")]  # no selecting row of its KV: no mix
    (mix,) = e2e.estimated_rows(rows, 0.25)
    assert mix["decode_ms"] == pytest.approx(0.25 * 6.0 + 0.75 * 10.0)
    assert mix["floor_ms"] == pytest.approx(0.25 * 5.0 + 0.75 * 8.0)
    assert mix["prefill_s"] == 2.0 and mix["estimated"] and mix["policy"] == "tokenselect at 25% hits (estimate)"
    assert e2e.estimated_rows(rows, 0.0)[0]["decode_ms"] == 10.0
    assert e2e.estimated_rows(rows, 1.0)[0]["decode_ms"] == 6.0


def test_dense_spec_names_its_chunk_and_sdpa_backend():
    assert e2e.dense_settings("dense", 4096, 512) == (512, "auto")
    assert e2e.dense_settings("dense:chunk=8192", 4096, 512) == (8192, "auto")
    assert e2e.dense_settings("dense:chunk=all", 4096, 512) == (4096, "auto")
    assert e2e.dense_settings("dense:chunk=all;sdpa=flash", 4096, 512) == (4096, "flash")
    assert e2e.dense_settings("dense:sdpa=cudnn", 4096, 512) == (512, "cudnn")
    for bad in ("dense:chunk=0", "dense:chunk=-3", "dense:chunk=some", "dense:k=3"):
        with pytest.raises(ValueError, match="chunk"):
            e2e.dense_settings(bad, 4096, 512)
    with pytest.raises(ValueError, match="sdpa must be one of auto, flash, cudnn"):
        e2e.dense_settings("dense:sdpa=math", 4096, 512)


@pytest.mark.parametrize("policies, message", [("dense:chunk=0", "chunk must be"), ("transformer", "unknown policy"),
                                               ("dense,tokenselect", "--hit-rate")])
def test_bench_e2e_refuses_bad_baselines_before_measuring(tmp_path, policies, message):
    parser = argparse.ArgumentParser()
    e2e.add_parser(parser.add_subparsers())
    args = parser.parse_args(["e2e", "--config", "tiny", "--lengths", "1k", "--policies", policies, "--hit-rate", "1.5",
                              "--device", "cpu", "--output", str(tmp_path)])
    with pytest.raises(SystemExit, match=message):
        args.func(args)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("bench", ["e2e", "attention"])
def test_a_bad_length_is_refused_before_anything_is_measured(tmp_path, monkeypatch, bench):
    """The copy bandwidth (and the matrix rate) take seconds on a GPU: a typo in --lengths is told before them."""
    module = {"e2e": e2e, "attention": attention}[bench]

    def measured(*_, **__):
        raise AssertionError("measured before the lengths were read")
    monkeypatch.setattr(module, "copy_bandwidth", measured)
    parser = argparse.ArgumentParser()
    module.add_parser(parser.add_subparsers())
    extra = ["--config", "tiny"] if bench == "e2e" else ["--tiny"]
    args = parser.parse_args([bench, *extra, "--lengths", "1k,4kb", "--device", "cpu", "--output", str(tmp_path)])
    with pytest.raises(ValueError, match="bad length '4kb'"):
        args.func(args)


def test_transformers_baseline_runs_the_engines_weights():
    """transformers' model built around the engine's tensors decodes the dense baseline's greedy tokens (fp32)."""
    llm = LLM.random(e2e.TINY, "full", device="cpu", kv_cache_tokens=16)
    model = transformers_model(llm, e2e.TINY)
    assert model.model.layers[0].mlp.down_proj.weight.data_ptr() == llm.model.model.layers[0].mlp.down_proj.weight.data_ptr()
    ids = e2e.text_prompt(300, e2e.TINY["vocab_size"])
    hf = measure_transformers(model, ids, decode_steps=3)
    assert hf["prefill_s"] > 0 and hf["decode_ms"] > 0
    assert hf["tokens"] == DenseRunner(llm, 320).generate(ids, 64, 5)


def test_bench_e2e_writes_transformers_one_pass_and_estimate_rows(tmp_path):
    parser = argparse.ArgumentParser()
    e2e.add_parser(parser.add_subparsers())
    args = parser.parse_args(["e2e", "--config", "tiny", "--layers", "1", "--lengths", "1k", "--policies",
                              "dense:chunk=all,transformers,tokenselect,tokenselect:theta=-1", "--hit-rate", "0.5",
                              "--decode-steps", "2", "--chunk-size", "256", "--kernels", "torch", "--device", "cpu",
                              "--output", str(tmp_path), "--tag", "t"])
    assert args.func(args) == 0
    result = json.loads((tmp_path / "e2e_t.json").read_text())
    rows = {r["policy"]: r for r in result["rows"]}
    assert result["copy_bandwidth"] > 0 and result["matmul_rate"] > 0
    assert rows["dense:chunk=all"]["chunk"] == 1024 and rows["transformers"]["chunk"] == 1024
    assert rows["tokenselect"]["chunk"] == 256  # --chunk-size reached the engine, and its floor counts it
    config = {**e2e.TINY, "num_hidden_layers": 1}
    for policy, settings, chunk in [("dense:chunk=all", None, 1024), ("transformers", None, 1024),
                                    ("tokenselect", rows["tokenselect"]["settings"], 256)]:
        flops = prefill_flops(config, settings, 1024, chunk)
        assert rows[policy]["prefill_flops"] == flops
        assert rows[policy]["prefill_floor_s"] == pytest.approx(flops["total"] / result["matmul_rate"])
    # inside the tiny model's window TokenSelect attends every token, as dense does
    assert rows["tokenselect"]["prefill_flops"]["attention"] == rows["dense:chunk=all"]["prefill_flops"]["attention"]
    assert rows["tokenselect at 50% hits (estimate)"]["prefill_floor_s"] == rows["tokenselect"]["prefill_floor_s"]
    mix = rows["tokenselect at 50% hits (estimate)"]
    assert mix["decode_ms"] == pytest.approx((rows["tokenselect"]["decode_ms"]
                                              + rows["tokenselect:theta=-1"]["decode_ms"]) / 2)
    table = (tmp_path / "e2e_t.md").read_text()
    assert "x at 1K: prefill against " in table and "GB/s" in table and "TFLOP/s" in table


def test_the_qwen_shape_builds_qwen2s_attention_with_its_bias_and_seven_heads_a_kv_head():
    """``bench e2e --config qwen2.5-0.5b`` (the eval tables' Qwen2.5-Coder-0.5B, random weights): the Qwen2 family's
    q/k/v bias and 14 query heads over 2 kv heads of 64 reach the model, and the floor counts those 2 kv heads."""
    parser = argparse.ArgumentParser()
    e2e.add_parser(parser.add_subparsers())
    config = e2e.model_config(parser.parse_args(["e2e", "--config", "qwen2.5-0.5b", "--layers", "2"]))
    llm = LLM.random(config, "full", device="cpu", kv_cache_tokens=16)
    qkv = llm.model.model.layers[0].self_attn.qkv_proj
    assert qkv.bias is not None and qkv.out_features == (14 + 2 * 2) * 64 and qkv.in_features == 896
    assert len(llm.model.model.layers) == 2
    floor = decode_floor(config, None, 1024, bandwidth=1e12)
    assert floor["attention"] == 2 * 1024 * 2 * 64 * 2 * 2  # layers x tokens x kv heads x head_dim x (K, V) x bf16


def _run(name, start, end, device=torch.autograd.DeviceType.CUDA):
    return FunctionEvent(id=0, name=name, thread=0, start_us=start, end_us=end, device_type=device)


def test_kernel_times_count_a_kernel_from_the_end_of_the_one_before():
    """A kernel launched dependent on the one before starts early and waits (kernels/launch.py): its time counts
    from the predecessor's end, a gap between kernels counts for neither, and host events are left out."""
    events = [_run("_rms_norm_kernel", 0.0, 10.0), _run("_scores_kernel", 6.0, 30.0),  # resident from 6, ran 10-30
              _run("nvjet_gemm", 32.0, 50.0),  # after a 2 us gap
              _run("_rms_norm_kernel", 50.0, 55.0),  # starts exactly at the end: nothing taken off
              _run("_merge_kernel", 51.0, 54.0),  # inside the one before (another stream): adds nothing
              _run("cudaGraphLaunch", 0.0, 60.0, torch.autograd.DeviceType.CPU)]
    times = {k.key: k.self_device_time_total for k in kernel_times(events)}
    assert times == {"_rms_norm_kernel": 15.0, "_scores_kernel": 20.0, "nvjet_gemm": 18.0, "_merge_kernel": 0.0}
    cuda = torch.autograd.DeviceType.CUDA
    assert all(k.device_type == cuda for k in kernel_times(events))
    text = profile_parts(kernel_times(events), steps=1, floor=None, bandwidth=1e12)
    assert "| all kernels | 0.053 | - | - |" in text  # 53 us of the 60 the step took: the gap is in no kernel

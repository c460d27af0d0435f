"""The end-to-end benchmark's dense baseline computes what the engine's full attention computes."""

from __future__ import annotations

import pytest
import torch

from tokenselect import LLM, SamplingParams
from tokenselect.bench.dense import DenseRunner, causal_attention, sdpa_backend
from tokenselect.kernels.cudnn_attention import merge_by_lse_ref


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, 300, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("chunk", [1, 32, 100])
def test_dense_runner_logits_equal_engine_full_attention(tiny_llama, chunk):
    llm = LLM(tiny_llama, "full", chunk_size=32, dtype="float32")  # fp32 on a GPU too, for the tolerance
    prompt = ids(150, 1)
    want = llm.prompt_logits(prompt)[-1]
    got = DenseRunner(llm, 200).prefill(prompt, chunk)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_dense_runner_greedy_equals_engine_full_attention(tiny_llama):
    llm = LLM(tiny_llama, "full", chunk_size=32)
    prompt = ids(90, 2)
    want = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0].token_ids
    assert DenseRunner(llm, 120).generate(prompt, 32, 10) == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention's decode graph runs on CUDA")
def test_dense_decode_graph_gives_the_sdpa_steps_logits(tiny_llama):
    """On CUDA in bf16 a decode step runs as one recorded graph, flash attention reading the key length on the
    device: every step replays the same graph and gives the logits SDPA gives for that step."""
    llm = LLM(tiny_llama, "full", chunk_size=32, dtype="bfloat16")
    graphed, plain = DenseRunner(llm, 200), DenseRunner(llm, 200)
    assert graphed.flash_decode
    plain.flash_decode = False
    prompt = ids(150, 3)
    token = plain.prefill(prompt, 32).argmax()
    graphed.prefill(prompt, 32)
    graphs = set()
    for _ in range(6):
        want, got = plain.forward(token.reshape(1)), graphed.forward(token.reshape(1))
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.05)
        assert got.argmax() == want.argmax()
        graphs.add(id(graphed.decode_graph))
        token = want.argmax()
    assert len(graphs) == 1 and graphed.decode_graph is not None and graphed.length == plain.length == 156


def attention_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor):
    """Plain attention (fp64) of q [B, H, c, d] over k, v [B, H, n, d] where visible [c, n]: (out, lse [B, H, c])."""
    scores = (q.double() @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~visible, float("-inf"))
    lse = scores.logsumexp(-1)
    return (scores - lse[..., None]).exp().nan_to_num() @ v.double(), lse


@pytest.mark.parametrize("cut", [3, 40, 64])
def test_attention_over_two_key_sets_merged_by_lse_is_attention_over_both(cut):
    """The cuDNN dense path's merge: attention over keys [0, cut) and over [cut, n), each with its log-sum-exp,
    merged, equals attention over all n keys, in either order; the causal edge leaves the first rows no key of the
    second set (lse -inf: weight 0), and at cut == n no row has one."""
    gen = torch.Generator().manual_seed(cut)
    q, k, v = (torch.randn(2, 3, 24, 16, generator=gen, dtype=torch.float64) for _ in range(3))
    k, v = k.repeat(1, 1, 3, 1)[:, :, :64], v.repeat(1, 1, 3, 1)[:, :, :64]  # n = 64 keys
    n, c = k.shape[2], q.shape[2]
    visible = torch.arange(n)[None, :] <= torch.arange(c)[:, None] + n - c  # bottom-right causal
    want, _ = attention_with_lse(q, k, v, visible)
    a = attention_with_lse(q, k[:, :, :cut], v[:, :, :cut], visible[:, :cut])
    b = attention_with_lse(q, k[:, :, cut:], v[:, :, cut:], visible[:, cut:])
    if cut == n:  # no key in the second part for any row
        b = (torch.zeros_like(want), torch.full(want.shape[:3], float("-inf"), dtype=torch.float64))
    # the merge runs in fp32: 1.7e-7 at most here
    torch.testing.assert_close(merge_by_lse_ref(*a, *b), want, rtol=0, atol=1e-6)
    torch.testing.assert_close(merge_by_lse_ref(*b, *a), want, rtol=0, atol=1e-6)


def test_dense_runner_refuses_a_backend_it_cannot_run(tiny_llama):
    llm = LLM(tiny_llama, "full", chunk_size=32, dtype="float32")
    assert DenseRunner(llm, 50).sdpa == "flash"  # auto: flash wherever cuDNN cannot run
    with pytest.raises(ValueError, match="cudnn"):  # on a CPU: no CUDA; on a GPU: not fp32
        DenseRunner(llm, 50, sdpa="cudnn")


def test_sdpa_backend_auto_and_names():
    cpu = torch.device("cpu")
    assert sdpa_backend("auto", cpu) == "flash" and sdpa_backend("flash", cpu) == "flash"
    with pytest.raises(ValueError, match="cudnn runs on a CUDA device"):
        sdpa_backend("cudnn", cpu)
    with pytest.raises(ValueError, match="one of auto, flash, cudnn"):
        sdpa_backend("math", cpu)
    cuda = torch.device("cuda")  # the dtype rule needs no GPU: it is decided before one is asked for
    with pytest.raises(ValueError, match="sdpa=cudnn takes bf16 or fp16, not torch.float32"):
        sdpa_backend("cudnn", cuda, torch.float32)
    assert sdpa_backend("auto", cuda, torch.float32) == "flash"
    if torch.cuda.is_available():
        hopper = torch.cuda.get_device_capability()[0] == 9
        assert sdpa_backend("auto", torch.device("cuda")) == ("cudnn" if hopper else "flash")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN attention runs on CUDA")
@pytest.mark.parametrize("c, L", [(1, 4096), (64, 4096), (1000, 3000), (512, 512)])
def test_cudnn_causal_attention_equals_flash(c, L):
    """Both backends of a dense chunk (a decode query, a chunk after cached keys, a whole prompt) on the runner's
    layout (token-major cache seen as [1, KV, L, d]: strided heads), GQA 4; bf16 outputs of values ~N(0, 1)
    averaged over >= 500 keys agree to bf16's rounding."""
    gen = torch.Generator(device="cuda").manual_seed(c)
    q = torch.randn(1, 32, c, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (torch.randn(L, 8, 128, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(0, 1)[None]
            for _ in range(2))
    want = causal_attention(q, k, v, "flash")
    got = causal_attention(q, k, v, "cudnn")
    torch.testing.assert_close(got.float(), want.float(), rtol=0.02, atol=4e-3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="cuDNN attention runs on CUDA")
def test_dense_runner_prefills_alike_with_cudnn_and_flash(tiny_llama):
    llm = LLM(tiny_llama, "full", chunk_size=32, dtype="bfloat16")
    prompt = ids(150, 4)
    flash, cudnn = DenseRunner(llm, 200, sdpa="flash"), DenseRunner(llm, 200, sdpa="cudnn")
    assert (flash.sdpa, cudnn.sdpa) == ("flash", "cudnn")
    for chunk in (32, 150):
        want, got = flash.prefill(prompt, chunk), cudnn.prefill(prompt, chunk)
        torch.testing.assert_close(got, want, rtol=0.02, atol=0.05)
        assert got.argmax() == want.argmax()
        flash.reset(), cudnn.reset()


def test_dense_runner_builds_plans_only_for_cudnn_and_forgets_the_prompt(tiny_llama):
    """``build_plans`` prefills the prompt untimed with cuDNN (its execution plans, one per chunk shape, cached) and
    leaves the runner empty: its next prefill is a fresh runner's; with flash it does nothing."""
    dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    llm = LLM(tiny_llama, "full", chunk_size=32, dtype=dtype)
    prompt = ids(150, 5)
    flash = DenseRunner(llm, 200, sdpa="flash")
    assert not flash.build_plans(prompt, 32) and flash.lengths == [0]
    if not torch.cuda.is_available():
        return
    fresh, warmed = DenseRunner(llm, 200, sdpa="cudnn"), DenseRunner(llm, 200, sdpa="cudnn")
    assert warmed.build_plans(prompt, 32) and warmed.lengths == [0]
    torch.testing.assert_close(warmed.prefill(prompt, 32), fresh.prefill(prompt, 32), rtol=0, atol=0)
    assert warmed.lengths == [150]


def test_dense_runner_refuses_length_dependent_rope(tiny_llama):
    """Keys rotated once when cached cannot follow dynamic NTK's changing frequencies."""
    with pytest.raises(ValueError, match="dynamic NTK"):
        DenseRunner(LLM(tiny_llama, "full", rope_scaling="dynamic:4"), 100)


def test_a_row_says_cudnn_chunks_where_they_ran():
    """The label follows what ran (``cudnn_chunks``), not the setting: full attention under a cudnn setting, whose
    live-length lists the Triton kernel serves, is unlabelled; a row measured before that was recorded is
    labelled by its setting; a dense row names its SDPA backend."""
    from tokenselect.bench.e2e import row_label

    assert row_label({"policy": "tokenselect", "chunk_attention": "cudnn", "cudnn_chunks": True}) == \
        "tokenselect (cudnn chunks)"
    assert row_label({"policy": "full", "chunk_attention": "cudnn", "cudnn_chunks": False}) == "full"
    assert row_label({"policy": "full", "chunk_attention": "cudnn"}) == "full (cudnn chunks)"
    assert row_label({"policy": "full", "chunk_attention": "triton"}) == "full"
    assert row_label({"policy": "dense:chunk=8192", "sdpa": "cudnn"}) == "dense:chunk=8192 (cudnn SDPA)"


def test_bench_e2e_times_dense_and_policies_with_ratios(tmp_path, monkeypatch):
    import argparse
    import json

    from tokenselect import cuda_graphs
    from tokenselect.bench import e2e

    monkeypatch.setattr(cuda_graphs, "PREFILL_MIN_CHUNKS", 4)  # the 8 chunks of 2k tokens are a long prompt

    parser = argparse.ArgumentParser()
    e2e.add_parser(parser.add_subparsers())
    args = parser.parse_args(["e2e", "--config", "tiny", "--lengths", "2k", "--policies", "dense,full,tokenselect,tokenselect:theta=-1",
                              "--decode-steps", "3", "--chunk-size", "256", "--kernels", "torch", "--device", "cpu",
                              "--output", str(tmp_path), "--tag", "t", "--cuda-graphs"])  # on a CPU: run eagerly
    assert args.func(args) == 0
    rows = json.loads((tmp_path / "e2e_t.json").read_text())["rows"]
    # the policies' timed decode steps ran as whole steps (cuda_graphs.py); dense has its own runner
    assert [r.get("whole_graph_steps") for r in rows] == [None, 3, 3, 3]
    # and all 8 prefill chunks, full attention's and TokenSelect's (inside its selection threshold attending
    # everything, as full attention, then selecting: a graph for each mode)
    assert [r.get("prefill_chunks") for r in rows] == [None, 8, 8, 8]
    assert [r["whole_graph_chunks"] for r in rows[1:]] == [8, 8, 8]
    assert [r["policy"] for r in rows] == ["dense", "full", "tokenselect", "tokenselect:theta=-1"]
    assert all(r["prefill_s"] > 0 and r["decode_ms"] > 0 for r in rows)
    assert rows[2]["hit_rate"] is not None and rows[0]["hit_rate"] is None
    assert rows[3]["hit_rate"] > 0.5  # theta -1: every decode step after a sequence's first reuses
    # the shipped model's hit rate on the same text, with each row's settings (theta -1: reuse after the first)
    assert "real_hit_rate" not in rows[0] and "real_hit_rate" not in rows[1]
    assert 0 <= rows[2]["real_hit_rate"] < rows[3]["real_hit_rate"] and rows[3]["real_hit_rate"] > 0.5
    table = (tmp_path / "e2e_t.md").read_text()
    dense = rows[0]
    # prefill ratios are against the faster of the rows that attend every token (dense, full), same run
    want = f"{min(dense['prefill_s'], rows[1]['prefill_s']) / rows[2]['prefill_s']:.2f}x"
    assert rows[0]["kv"] == rows[2]["kv"] == "fp32"  # dense's rotated cache and the engine's pool: the model's dtype
    # each row's memory floor at its own hit rate: the selecting step reads every middle key, a hit none of them
    assert rows[2]["floor"]["scoring"] > 0 and rows[3]["floor"]["scoring"] < rows[2]["floor"]["scoring"]
    assert f"| {rows[2]['floor_ms']:.2f} | {rows[2]['floor_ms'] / rows[2]['decode_ms']:.0%} |" in table
    assert f"| 2K | tokenselect | fp32 | {rows[2]['prefill_s']:.2f} | {want} |" in table
    assert "| 3/3 |" in table and "| 8/8 |" in table
    # the torch kernels have no cuDNN path: no row says its chunks ran by cuDNN
    assert [r["cudnn_chunks"] for r in rows[1:]] == [False] * 3 and "cudnn chunks" not in table
    assert f"| {rows[3]['hit_rate']:.0%} ({rows[3]['real_hit_rate']:.0%}) |" in table


def test_bench_e2e_with_fp8_weights_runs_every_row_so_and_floors_them_so(tmp_path):
    """--weight-dtype fp8 reaches the dense row's model and the engine's, the table says so, and each decode floor
    counts a byte a layer-matrix element (the head and embeddings in the model's dtype); transformers is refused."""
    import argparse
    import json

    from tokenselect.bench import e2e, floors

    parser = argparse.ArgumentParser()
    e2e.add_parser(parser.add_subparsers())
    common = ["e2e", "--config", "tiny", "--lengths", "1k", "--decode-steps", "2", "--chunk-size", "256", "--kernels",
              "torch", "--device", "cpu", "--output", str(tmp_path), "--weight-dtype", "fp8"]
    args = parser.parse_args([*common, "--policies", "dense,full", "--tag", "f"])
    assert args.func(args) == 0
    rows = json.loads((tmp_path / "e2e_f.json").read_text())["rows"]
    assert [r["weights"] for r in rows] == ["fp8", "fp8"]
    config = e2e.model_config(args)
    fp32 = floors.weight_bytes(config, 4)
    want = fp32 - config["num_hidden_layers"] * floors.layer_matrix_params(config) * 3
    assert [r["floor"]["weights"] for r in rows] == [want, want]
    table = (tmp_path / "e2e_f.md").read_text()
    assert "fp8 weights" in table and "| full (fp8 weights) |" in table
    args = parser.parse_args([*common, "--policies", "transformers", "--tag", "g"])
    with pytest.raises(SystemExit, match="16-bit weights"):
        args.func(args)


def test_bench_e2e_merges_runs_into_one_table(tmp_path):
    """Runs made one device call each (here: two lengths, two KV settings, fp8 selection keys) become one table
    and plot, in order of length, each row with its own KV setting and its ratio against the dense row of its own
    length."""
    import argparse
    import json

    from tokenselect.bench import e2e

    parser = argparse.ArgumentParser()
    e2e.add_parser(parser.add_subparsers())
    common = ["--config", "tiny", "--decode-steps", "2", "--chunk-size", "256", "--kernels", "torch", "--device", "cpu",
              "--output", str(tmp_path)]
    for length, tag, kv, select in (("2k", "long", "fp8", "fp8"), ("1k", "short", "auto", "fp8")):
        args = parser.parse_args(["e2e", "--lengths", length, "--policies", "dense,streaming", "--kv-dtype", kv,
                                  "--select-dtype", select, "--tag", tag, *common])
        assert args.func(args) == 0
    args = parser.parse_args(["e2e", "--merge", str(tmp_path / "e2e_long.json"), str(tmp_path / "e2e_short.json"),
                              "--output", str(tmp_path), "--tag", "all"])
    assert args.func(args) == 0
    merged = json.loads((tmp_path / "e2e_all.json").read_text())
    rows = merged["rows"]
    assert [(r["length"], r["policy"], r["kv"]) for r in rows] == [
        (1024, "dense", "fp32"), (1024, "streaming", "fp32, fp8 selection keys"), (2048, "dense", "fp32"),
        (2048, "streaming", "fp8")]  # (dense's cache is in the model's dtype; an fp8 pool is its own selection keys)
    assert merged["merged"] == ["e2e_long.json", "e2e_short.json"]
    table = (tmp_path / "e2e_all.md").read_text()
    assert "merged from e2e_long, e2e_short" in table
    for dense, sparse in (rows[:2], rows[2:]):
        n = f"{sparse['length'] // 1024}K"
        ratio = f"{dense['prefill_s'] / sparse['prefill_s']:.2f}x"
        assert f"| {n} | streaming | {sparse['kv']} | {sparse['prefill_s']:.2f} | {ratio} |" in table
    assert (tmp_path / "e2e_all.png").stat().st_size > 0
    # a rerun of one row (here: the short run's streaming row, measured again) replaces it in place
    rerun = json.loads((tmp_path / "e2e_short.json").read_text())
    rerun["rows"] = [{**rerun["rows"][1], "prefill_s": 123.0}]
    (tmp_path / "e2e_rerun.json").write_text(json.dumps(rerun))
    args = parser.parse_args(["e2e", "--merge", str(tmp_path / "e2e_long.json"), str(tmp_path / "e2e_short.json"),
                              str(tmp_path / "e2e_rerun.json"), "--output", str(tmp_path), "--tag", "all"])
    assert args.func(args) == 0
    again = json.loads((tmp_path / "e2e_all.json").read_text())["rows"]
    assert [r["prefill_s"] for r in again] == [rows[0]["prefill_s"], 123.0, rows[2]["prefill_s"], rows[3]["prefill_s"]]


def test_policy_specs_carry_their_own_settings():
    from tokenselect.policies import policy_spec

    assert policy_spec("tokenselect") == ("tokenselect", {})
    assert policy_spec("tokenselect:theta=-1;k=4096;selector=topk") == (
        "tokenselect", {"theta": -1, "k": 4096, "selector": "topk"})
    assert policy_spec("tokenselect:score_scale=a=b; k = 8") == ("tokenselect", {"score_scale": "a=b", "k": 8})
    with pytest.raises(ValueError, match="KEY=VALUE"):
        policy_spec("tokenselect:theta")


def test_bench_e2e_refuses_an_unknown_policy(tmp_path):
    import argparse

    from tokenselect.bench import e2e

    parser = argparse.ArgumentParser()
    e2e.add_parser(parser.add_subparsers())
    args = parser.parse_args(["e2e", "--config", "tiny", "--lengths", "1k", "--policies", "dense,tokenselekt:k=8",
                              "--device", "cpu", "--output", str(tmp_path)])
    with pytest.raises(SystemExit, match="unknown policy 'tokenselekt:k=8'"):
        args.func(args)
    assert not list(tmp_path.iterdir())  # refused before measuring anything


def test_bench_e2e_frees_each_length_engine_before_the_next(tmp_path, monkeypatch):
    """The engine built for one length (its KV pool) is gone before the next length's engine is built: on a GPU a
    leftover pool would be counted in the next length's peak memory and could make it not fit."""
    import argparse
    import weakref

    from tokenselect.bench import e2e
    from tokenselect.engine import LLM

    pools, alive_at_build, started_with = [], [], []
    build = LLM.random.__func__

    def recording(cls, config, attention, *args, **kwargs):
        alive_at_build.append([ref() is not None for ref in pools])
        started_with.append(attention)
        llm = build(cls, config, attention, *args, **kwargs)
        pools.append(weakref.ref(llm.cache.k))
        return llm

    monkeypatch.setattr(LLM, "random", classmethod(recording))
    parser = argparse.ArgumentParser()
    e2e.add_parser(parser.add_subparsers())
    args = parser.parse_args(["e2e", "--config", "tiny", "--lengths", "1k,2k", "--policies", "full,tokenselect",
                              "--decode-steps", "2", "--chunk-size", "256", "--kernels", "torch", "--device", "cpu",
                              "--output", str(tmp_path), "--cuda-graphs"])
    assert args.func(args) == 0
    # per length an engine for full attention and one started with TokenSelect (whose own selection keys it holds)
    assert started_with == ["full", "tokenselect"] * 2
    assert alive_at_build == [[False] * n for n in range(4)]


def test_engine_groups_give_tokenselect_its_own_engine_only_where_auto_gives_it_fp8_keys():
    """With select_dtype auto an engine started with TokenSelect makes an fp8 copy of the keys (on a GPU), one
    started with another policy does not: the bench's rows take an engine each kind, in their order. With fp8 or kv
    every row gets the same keys, so one engine serves them all."""
    from tokenselect.bench.e2e import engine_groups

    rows = ["full", "tokenselect", "infllm", "tokenselect:theta=-1"]
    assert engine_groups(rows, "auto") == [["full", "infllm"], ["tokenselect", "tokenselect:theta=-1"]]
    assert engine_groups(rows, "fp8") == engine_groups(rows, "kv") == [rows]
    assert engine_groups(["tokenselect"], "auto") == [["tokenselect"]]

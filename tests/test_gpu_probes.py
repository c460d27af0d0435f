"""The probes under benchmarks/ (where a compile or a memory peak comes from; whether prefill selections would be
reused), run where they can be: the allocator-trace replay and the reuse replay on made-up inputs, the compile probe
end to end on the CPU (where nothing compiles)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import torch

from tokenselect.kernels.cudnn_attention import cudnn_attention_ref

from benchmark_scripts import BENCHMARKS, load


def frame(path: str, line: int, name: str) -> dict:
    return {"filename": path, "line": line, "name": name}


def test_the_memory_peak_is_the_most_bytes_alive_at_once_by_the_line_that_allocated_them():
    """Frees end a block's life; the peak's blocks are counted by their innermost frame in tokenselect/; a free of a
    block allocated before the trace began is ignored; a block with no frame of ours keeps its innermost one."""
    probe = load("memory_peak_gpu")
    ours = [frame("/torch/x.py", 9, "empty"), frame("/site/tokenselect/kernels/topk.py", 214, "topk"),
            frame("/site/tokenselect/engine.py", 40, "step")]
    trace = [
        {"action": "free_completed", "addr": 99, "size": 1000},  # allocated before the trace
        {"action": "alloc", "addr": 1, "size": 100, "frames": ours},
        {"action": "alloc", "addr": 2, "size": 50, "frames": [frame("/torch/y.py", 3, "f")]},
        {"action": "free_completed", "addr": 2, "size": 50},
        {"action": "alloc", "addr": 3, "size": 70, "frames": ours},
        {"action": "alloc", "addr": 4, "size": 5, "frames": []},  # the peak: 175 bytes
        {"action": "free_completed", "addr": 3, "size": 70},
        {"action": "alloc", "addr": 5, "size": 60, "frames": ours},  # 165: below the peak
    ]
    peak, at_peak = probe.live_at_peak({"device_traces": [trace]})
    assert peak == 175
    assert dict(at_peak) == {"kernels/topk.py:214 topk": 170, "?": 5}


def test_the_compile_probe_times_the_warm_up_and_each_repeat(tmp_path):
    """On the CPU (no Triton compile): a warm-up and two timed prefills of the tiny model, none with a compile."""
    load("first_prefill_compiles_gpu").main([str(tmp_path), "3000", "--config", "tiny", "--device", "cpu"])
    result = json.loads((tmp_path / "first_prefill_compiles.json").read_text())
    assert [p["phase"] for p in result["phases"]] == ["warm-up", "timed 1", "timed 2"]
    assert result["phases"][0]["prefill_s"] is None and all(p["prefill_s"] > 0 for p in result["phases"][1:])
    assert result["compiles"] == [] and result["length"] == 3000
    assert "| timed 2 |" in (tmp_path / "first_prefill_compiles.md").read_text()


def test_the_warm_up_probe_times_first_requests_with_and_without_it(tmp_path):
    """On the CPU (no Triton compile): an engine of the shipped model in a process of its own without a warm-up and
    one with it, each timing the same three ragged prompts (near --request-tokens) twice; the warm-up's seconds only
    where it ran."""
    load("warm_up_first_requests_gpu").main([str(tmp_path), "--tokens", "300", "--request-tokens", "320",
                                             "--warm-ups", "0,300", "--max-tokens", "2", "--device", "cpu"])
    result = json.loads((tmp_path / "warm_up_first_requests.json").read_text())
    assert (result["tokens"], result["request_tokens"], result["max_tokens"]) == (300, 320, 2)
    cold, warm = result["rows"]
    assert (cold["warm_up_tokens"], warm["warm_up_tokens"]) == (0, 300)
    assert cold["warm_up_s"] == 0 and warm["warm_up_s"] > 0
    for row in result["rows"]:
        assert [(r["round"], r["tokens"]) for r in row["requests"]] == [(1, 315), (1, 237), (1, 167)] + [
            (2, 315), (2, 237), (2, 167)]
        assert all(r["seconds"] > 0 and r["compiles"] == [] for r in row["requests"])
    assert "| 300 |" in (tmp_path / "warm_up_first_requests.md").read_text()


def test_the_compile_log_takes_each_variant_in_the_phase_it_ended_in_and_restores_the_hooks():
    """``logged_compiles`` (both compile probes' hooks): a variant Triton reports as compiled is logged under
    ``phase[0]`` at its end, with its kernel, argument names and the seconds since its cache miss; Triton's hooks
    are the process's own again after the block."""
    from triton import knobs
    probe = load("first_prefill_compiles_gpu")
    before = knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook

    class Kernel:
        name, arg_names = "_k", ["x_ptr", "N"]

    hook = dict(repr="_k[...]", fn=Kernel(), compile={"configs": None}, is_manual_warmup=False,
                already_compiled=False)
    phase = ["warm-up"]
    with probe.logged_compiles(phase) as compiles:
        assert knobs.runtime.jit_cache_hook(key="k1", **hook) is False  # a miss does not skip the compile
        phase[0] = "timed 1"
        knobs.runtime.jit_post_compile_hook(key="k1", **hook)
    assert (knobs.runtime.jit_cache_hook, knobs.runtime.jit_post_compile_hook) == before
    assert [(c["phase"], c["kernel"], c["key"], c["arg_names"]) for c in compiles] == [
        ("timed 1", "_k", "k1", ["x_ptr", "N"])]
    assert 0 <= compiles[0]["seconds"] < 5


def test_the_compile_probe_names_the_arguments_specialized_anew():
    """A compile after the warm-up is named by the arguments in which it differs from the warm-up's nearest variant
    of its kernel (keys as Triton 3.6 writes them, from an H200 run: a length no longer divisible by 16)."""
    probe = load("first_prefill_compiles_gpu")
    opts = "{'debug': False, 'instrumentation_mode': ''}"
    names = ["s_ptr", "n_valid_ptr", "N", "stride_s", "BLOCK"]

    def record(phase, kernel, *specs):
        return {"phase": phase, "kernel": kernel, "arg_names": names, "key": f"[{', '.join(specs)}]{opts}"}
    warm = [record("warm-up", "_vote_kernel", "('*fp32', 'D')", "('*i64', 'D')", "('i32', 'D')", "('i32', 'D')",
                   "('constexpr', 128)"),
            record("warm-up", "_vote_kernel", "('*fp32', 'D')", "('*i64', 'D')", "('i32', '')", "('i32', '')",
                   "('constexpr', 64)"),
            record("warm-up", "_topk_kernel", "('*fp32', 'D')", "('*i64', 'D')", "('i32', '')", "('i32', '')",
                   "('constexpr', 128)")]
    late = record("timed 1", "_vote_kernel", "('*fp32', 'D')", "('*i64', 'D')", "('i32', '')", "('i32', 'D')",
                  "('constexpr', 128)")
    assert probe.changed_args(late, warm + [late]) == ["N: ('i32', '')"]
    assert probe.changed_args(dict(late, kernel="_other_kernel"), warm) == []


def test_the_warm_up_also_ends_prompts_inside_a_chunk():
    """``LLM.warm_up`` (bench e2e's warm-up, which the probes and benches share, and the server's) prefills its
    prompt, then one WARMUP_RAGGED tokens shorter, whose length is not a multiple of 16 (Triton's other variant of
    every kernel that takes a length), then one whose last chunk holds WARMUP_RAGGED tokens (the sparse
    attention's small-chunk tile). With a prefix cache, the later prompts reuse none of the first's chunks (a reused
    chunk would not run). It leaves no prompt in the prefix cache and every KV slot free."""
    from tokenselect.bench import e2e
    from tokenselect.engine import LLM, WARMUP_RAGGED
    llm = LLM.random(e2e.CONFIGS["tiny"], "tokenselect", device="cpu", kv_cache_tokens=1024, prefix_cache=True,
                     chunk_size=128)
    runs, generate = [], llm.generate

    def generate_and_count(prompts, params):
        out = generate(prompts, params)
        runs.append((len(prompts[0]), llm.stats()["prefix_cache_hit_tokens"]))
        return out

    llm.generate = generate_and_count
    e2e.warm_up(llm, list(range(1, 641)))
    assert runs == [(640, 0), (640 - WARMUP_RAGGED, 0), (4 * 128 + WARMUP_RAGGED, 0)] and WARMUP_RAGGED % 2
    assert e2e.WARMUP_TOKENS % 16 == 0 and (e2e.WARMUP_TOKENS - WARMUP_RAGGED) % 16
    stats = llm.stats()
    assert stats["prefix_cache_tokens"] == 0 and stats["kv_slots_free"] == stats["kv_slots"], stats


def test_prefill_reuse_replays_the_selection_caches_rule_per_layer():
    """A query reuses while its cosine with the query of the last miss reaches theta (at theta exactly: reused);
    a miss becomes the new reference; each layer has its own."""
    reused = load("prefill_selection_reuse").reused
    e1, e2, a, b = (torch.tensor(v) for v in ([1.0, 0.0], [0.0, 1.0], [4.0, 3.0], [3.0, 4.0]))
    # cos(e1, a) = 0.8, cos(e1, b) = 0.6, cos(a, b) = 0.96
    queries = {0: [e1, a, b, a], 1: [e2, e2]}
    assert reused(queries, 0.8) == (3, 6)  # layer 0: miss, hit at 0.8, miss (b the reference), hit; layer 1: hit
    assert reused(queries, 0.97) == (1, 6)  # only layer 1's equal queries
    assert reused(queries, 0.5) == (4, 6)


def test_the_scores_kernels_instructions_counted_without_a_gpu():
    """kernel_sass compiles the scores kernel for sm_90 on a machine without a GPU (run as a script: the tests'
    interpreter mode compiles nothing) and counts its key-block loop: the shipped statistics' flushed exponentials
    issue fewer instructions than tl.exp's (one MUFU.EX2 an element against four instructions), and no statistics
    fewer still; the loop holds the tensor-core products of a 16 x block x 128 tile (m16n8k16: block / 8 * 8 HMMA
    over the warps) and an exponential a score of its 16 rows. Its registers allow the programs an SM it was timed
    with (12 of 64 keys on a warp, 154 registers; shared memory allows 13): on the former tile, storing the scores'
    padding took it from 96 to 108 registers, 4 programs an SM where 5 ran, and a 1M decode step 1 ms slower."""
    from tokenselect.kernels.paged_dot import SCORES_TILE
    block, warps = SCORES_TILE[:2]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(BENCHMARKS.parent), env.get("PYTHONPATH", "")])
    counts = {}
    for variant in ("shipped", "plain-exp", "no-stats"):
        out = subprocess.run([sys.executable, str(BENCHMARKS / "kernel_sass.py"), "--variant", variant], env=env,
                             capture_output=True, text=True, check=True).stdout.splitlines()
        counts[variant] = int(re.search(rf"sm_90: (\d+) instructions a thread a block of {block} keys", out[0]).group(1))
        histogram = dict((op, int(n)) for op, n in (item.split() for item in out[1].split(", ")))
        assert histogram["HMMA"] == 16 * block * 128 // (16 * 8 * 16) // warps, out
        assert histogram.get("MUFU", 0) == (0 if variant == "no-stats" else 16 * block // (32 * warps)), out
        by_regs, by_shared = map(int, re.search(r"(\d+) programs an SM by registers, (\d+) by shared", out[2]).groups())
        if variant == "shipped":
            assert by_regs >= 12 and by_shared >= 12, out
    assert counts["no-stats"] < counts["shipped"] < counts["plain-exp"], counts


def test_the_scores_epilogue_variants_compute_the_shipped_kernels_scores_and_statistics(monkeypatch):
    """Each variant the epilogue bench times is the shipped kernel's computation (checked here in the interpreter,
    fp8 and bf16 keys, a ragged length), and a tile's statistics agree once combined into each head's totals."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    bench = load("scores_epilogue_gpu")
    gen = torch.Generator().manual_seed(0)
    n = 300
    q = torch.randn(32, 128, generator=gen).to(torch.bfloat16)
    for dtype in (torch.float8_e4m3fn, torch.bfloat16):
        pool = torch.randn(n + 24, 8, 128, generator=gen).to(dtype)
        slots, live = torch.randperm(n + 24, generator=gen)[:n], torch.tensor(n)
        shipped = bench.launcher(bench.paged_dot._scores_kernel, True, {})(q, pool, slots, live)
        for edits, extra in ((bench.REAL_ROWS, {"G_P": 4}), (bench.KEYS_AS_A, {}), (bench.PLAIN_EXP, {})):
            got = bench.launcher(bench.edited_kernel(edits), True, extra)(q, pool, slots, live)
            for g, w in zip(got, shipped):
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4)
        tiled = bench.at_tile((128, 4, 4, 3))(q, pool, slots, live)
        assert tiled[1].shape[1] == 3 and shipped[1].shape[1] == 5  # blocks of 128 keys against 64
        for g, w in zip((tiled[0], *bench.head_totals(*tiled[1:])), (shipped[0], *bench.head_totals(*shipped[1:]))):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4)


def test_the_incremental_prefill_selection_probe_scores_the_whole_middle_only_when_refreshed(monkeypatch, capsys):
    """The embedded model over 3,000 tokens of prose in 128-token chunks: chained incremental picks score about a
    third of the middle and keep most of the exact picks; refreshed every chunk (--refresh 1) they score all of it."""
    from tokenselect.data import default_model_path

    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the probe imports real_model_checks, beside it
    probe = load("prefill_selection_reuse")
    shares = {}
    for refresh in (0, 1):
        probe.main([str(default_model_path()), "3000", "128", "--refresh", str(refresh)])
        line = capsys.readouterr().out.splitlines()[-1]
        found = re.search(r"\(mean ([0-9.]+)\); scores ([0-9.]+)% of the live middle", line)
        shares[refresh] = float(found.group(1)), float(found.group(2))
    assert shares[1][1] == 100.0 and 10.0 < shares[0][1] < 60.0, shares
    assert all(0.5 < kept <= 1.0 for kept, _ in shares.values()), shares


def test_the_chunk_tile_sweep_swaps_the_tile_and_draws_a_prefill_groups_lists():
    """The sweep's tile is the one ``sparse_attention`` launches inside the block, and the shipped one after; each
    group's list is LIST distinct slots, its own queries' last, the others outside every group's own."""
    sweep = load("chunk_attention_tiles_gpu")
    attention = sweep.attention
    shipped = attention.CHUNK_TILE
    with sweep.chunk_tile((128, 128, 8, 2)):
        assert attention.CHUNK_TILE == (128, 128, 8, 2)
    assert attention.CHUNK_TILE == shipped
    lists = sweep.lists(torch.Generator().manual_seed(0), torch.device("cpu"))
    assert lists.shape == (sweep.GROUPS, sweep.LIST)
    own = torch.arange(sweep.POOL - sweep.QUERIES * sweep.GROUPS, sweep.POOL).view(sweep.GROUPS, sweep.QUERIES)
    assert torch.equal(lists[:, -sweep.QUERIES:], own)
    assert all(row.unique().numel() == sweep.LIST for row in lists)
    assert int(lists[:, :-sweep.QUERIES].max()) < sweep.POOL - sweep.QUERIES * sweep.GROUPS


def test_the_chunk_attention_paths_parts_make_the_sparse_attention(monkeypatch):
    """The paths bench's cuDNN parts as ``sparse_attention``'s path runs them: the keys rotated and the values
    gathered at each group's list, the queries rotated at their positions, the context and own attention (cuDNN's
    reference in its place) merged: the reference's sparse attention of each group."""
    paths = load("chunk_attention_paths_gpu")
    monkeypatch.setattr(paths, "POOL", 600)
    monkeypatch.setattr(paths, "CONTEXT", 100)
    monkeypatch.setattr(paths, "LAYERS", 1)
    monkeypatch.setattr(paths, "cudnn_attention", cudnn_attention_ref)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the kernels compiled, or interpreted
    (ops,) = paths.operands(torch.Generator().manual_seed(0), 2, 64, device)
    parts = paths.CudnnParts(ops)
    prepared = parts.prepare()
    got = parts.merge(parts.context(*prepared), parts.own(*prepared))
    assert ops["slots"].shape == (2, 164) and got.shape == ops["q"].shape
    for b in range(2):
        want = paths.attention.sparse_attention_ref(ops["q"][b], ops["k_pool"], ops["v_pool"], ops["slots"][b],
                                                    ops["key_pos"], ops["q_pos"][b], ops["inv_freq"])
        torch.testing.assert_close(got[b].float(), want.float(), rtol=2 ** -6, atol=2e-2 * want.abs().max().item())

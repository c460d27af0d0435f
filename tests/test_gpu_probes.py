"""The probes under benchmarks/ (where a compile or a memory peak comes from; whether prefill selections would be
reused), run where they can be: the allocator-trace replay and the reuse replay on made-up inputs, the compile probe
end to end on the CPU (where nothing compiles)."""

from __future__ import annotations

import json

import torch

from benchmark_scripts import load


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

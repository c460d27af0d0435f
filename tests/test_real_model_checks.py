"""benchmarks/real_model_checks.py: agreement with full attention inside the window, and the Selection Cache's hit
rate on prose, on the tiny checkpoint (window 256)."""

from __future__ import annotations

import json

from benchmark_scripts import load


def test_checks_agree_inside_the_window_and_count_the_selection_caches_hits(tiny_llama, tmp_path, monkeypatch):
    """Lengths are 1/4, 1/2 and 1x the window; a selective policy at its default (dense_until = the window) agrees
    with full attention at 100% at each, and so does the papers' rule where its sinks + window hold the whole
    context (64 tokens < 4 + 128). Of 3 tokens the first comes from the prefill and 2 from decode steps, each looking
    up the Selection Cache in the 2 layers: theta -1 stores at the first step and reuses at the second (2 hits of 4);
    --kv-cache-tokens sizes the engine's pool."""
    module = load("real_model_checks")
    engines = []
    real_llm = module.LLM
    monkeypatch.setattr(module, "LLM", lambda *a, **k: engines.append(real_llm(*a, **k)) or engines[-1])
    module.main(["--model", str(tiny_llama), "--out", str(tmp_path), "--positions", "16", "--policies",
                 "streaming,streaming:dense_until=0", "--prose-length", "300", "--decode", "3", "--thetas", "0.9,-1",
                 "--kv-cache-tokens", "2048"])
    assert engines[0].cache.n_slots == 2048
    data = json.loads((tmp_path / "real_model_checks.json").read_text())
    agree = {(r["policy"], r["length"]): r for r in data["agreement"]}
    assert sorted(agree) == [(p, n) for p in ("streaming", "streaming:dense_until=0") for n in (64, 128, 256)]
    assert all(agree[("streaming", n)]["top1_agreement"] == 100.0 for n in (64, 128, 256))
    assert agree[("streaming:dense_until=0", 64)]["top1_agreement"] == 100.0
    assert all(r["positions"] == 16 for r in agree.values())
    hits = {r["theta"]: r for r in data["hit_rates"]}
    assert hits[-1.0]["lookups"] == 4 and hits[-1.0]["hit_rate"] == 50.0
    assert hits[0.9]["lookups"] == 4 and hits[0.9]["prompt_tokens"] == 300
    text = (tmp_path / "real_model_checks.md").read_text()
    assert "| streaming:dense_until=0 | 100.0 |" in text and "| -1.0 | 50.0% | 4 |" in text

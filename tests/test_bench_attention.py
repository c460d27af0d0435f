"""``tokenselect bench attention`` end to end at tiny sizes on the CPU (a smoke test of every timed path)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from tokenselect.bench import attention


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    attention.add_parser(parser.add_subparsers())
    return parser.parse_args(["attention", *argv])


def test_tiny_cpu_run_writes_table_and_json(tmp_path):
    args = parse("--device", "cpu", "--tiny", "--kernels", "torch", "--lengths", "1k,2k", "--fp8-select",
                 "--output", str(tmp_path), "--tag", "smoke")
    assert args.func(args) == 0
    result = json.loads((tmp_path / "attention_smoke.json").read_text())
    rows = result["rows"]
    assert [r["length"] for r in rows] == [1024, 2048]
    assert rows[0]["max_abs_diff_dense_flash_vs_full_list"] < 0.05  # dense and full-list sparse attention agree
    assert rows[0]["dense_chunk_sdpa"] == "flash" and list(rows[0]["dense_chunk_by_sdpa"]) == ["flash"]  # no cuDNN
    for r in rows:
        for key in ("dense_chunk_ms", "dense_decode_ms", "chunk_ms", "miss_ms", "hit_ms", "floor_ms", "fp8_chunk_ms"):
            assert r[key] > 0
    table = (tmp_path / "attention_smoke.md").read_text()
    assert "| 1K |" in table and "| 2K |" in table and "chunk speedup" in table


def test_the_report_leads_with_the_graph_table_where_there_is_one(tmp_path):
    """A CPU run has no graph timings: the host-launched table alone. A CUDA run's rows (the same keys plus the
    graph timings) put the chunks' table in graphs first, its ratios from its own columns."""
    args = parse("--device", "cpu", "--tiny", "--kernels", "torch", "--lengths", "1k", "--output", str(tmp_path))
    assert args.func(args) == 0
    result = json.loads((tmp_path / "attention.json").read_text())
    assert "CUDA graphs" not in attention.render(result) and "| 1K |" in attention.render(result)
    result["rows"][0].update(graph_dense_chunk_ms=3.0, graph_chunk_ms=0.5, graph_fp8_chunk_ms=0.25,
                             graph_dense_decode_ms=0.2, graph_miss_ms=0.4, graph_hit_ms=0.1, graph_fp8_miss_ms=0.3,
                             fp8_floor_ms=result["rows"][0]["floor_ms"] / 2)
    result["args"]["fp8_select"] = True
    result["rows"][0].update(fp8_chunk_ms=1.0, fp8_miss_ms=1.0)
    text = attention.render(result)
    graphs, eager = text.index("CUDA graphs"), text.index("Launched from the host")
    assert graphs < eager and "| 1K | 3.000 | 0.500 | 6.0x |" in text[graphs:eager]
    assert "| 0.200 | 0.400 |" in text[graphs:eager] and "| 0.100 | 0.500x |" in text[graphs:eager]
    assert "| 0.250 | 12.0x |" in text[graphs:eager]


def test_dense_figures_are_the_faster_backends_and_name_it(tmp_path):
    """Where flash and cuDNN both ran, each dense cell is the faster one's, named, the ratios are against it, and a
    line gives every backend's time."""
    args = parse("--device", "cpu", "--tiny", "--kernels", "torch", "--lengths", "1k", "--output", str(tmp_path))
    assert args.func(args) == 0
    result = json.loads((tmp_path / "attention.json").read_text())
    row = result["rows"][0]
    for stem, by in (("dense_chunk", {"flash": 3.0, "cudnn": 1.5}), ("dense_decode", {"flash": 0.2, "cudnn": 0.25})):
        attention.fastest(row, f"{stem}_ms", by)
    assert (row["dense_chunk_ms"], row["dense_chunk_sdpa"]) == (1.5, "cudnn")
    assert (row["dense_decode_ms"], row["dense_decode_sdpa"]) == (0.2, "flash")
    row["chunk_ms"] = 0.5
    text = attention.render(result)
    assert "| 1K | 1.500 cudnn | 0.500 | 3.0x |" in text and "| 0.200 flash |" in text
    assert "1K dense chunk: flash 3.000, cudnn 1.500" in text and "1K dense decode: flash 0.200, cudnn 0.250" in text


def test_the_chunks_attention_is_resolved_as_the_engines_and_named(tmp_path):
    """--chunk-attention reaches the kernels as the engine's setting does: auto on a CPU is the kernels' own path
    (recorded, the title silent), cudnn where it cannot run is refused with the reason, and a cuDNN run's title
    names it."""
    args = parse("--device", "cpu", "--tiny", "--kernels", "torch", "--lengths", "1k", "--output", str(tmp_path),
                 "--no-check")
    assert args.chunk_attention == "auto" and args.func(args) == 0
    result = json.loads((tmp_path / "attention.json").read_text())
    assert result["chunk_attention"] == "triton" and "chunks' attention by" not in attention.render(result)
    result["chunk_attention"] = "cudnn"
    assert "torch kernels, chunks' attention by cudnn, on cpu" in attention.render(result)
    refused = parse("--device", "cpu", "--tiny", "--kernels", "torch", "--chunk-attention", "cudnn", "--output",
                    str(tmp_path))
    with pytest.raises(ValueError, match="cudnn runs with the triton kernels on CUDA in bf16 or fp16, not with torch"):
        refused.func(refused)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_full_size_on_cpu_is_refused(tmp_path):
    args = parse("--device", "cpu", "--output", str(tmp_path))
    with pytest.raises(SystemExit, match="--tiny"):
        args.func(args)


def test_a_backend_that_cannot_be_captured_is_left_out_and_named(monkeypatch):
    """cuDNN's dense call failing in a CUDA graph leaves flash's time alone, with the refusal in the row; flash
    failing is an error."""
    class Layer:  # dense(c, sdpa) -> what graph_ms is handed: the backend's name, or "broken" for those listed
        def __init__(self, broken):
            self.broken = broken

        def dense(self, c, sdpa):
            return "broken" if sdpa in self.broken else sdpa

    def graph_ms(fn):
        if fn == "broken":
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        return {"flash": 1.0, "cudnn": 0.5}[fn]

    monkeypatch.setattr(attention, "graph_ms", graph_ms)
    row = {}
    assert attention.graph_dense(Layer(["cudnn"]), 1, ["flash", "cudnn"], row) == {"flash": 1.0}
    assert row["sdpa_errors"] == {"cudnn, 1 queries, in a graph": "operation not permitted when stream is capturing"}
    assert attention.graph_dense(Layer([]), 1, ["flash", "cudnn"], {}) == {"flash": 1.0, "cudnn": 0.5}
    with pytest.raises(RuntimeError, match="capturing"):
        attention.graph_dense(Layer(["flash"]), 1, ["flash", "cudnn"], {})


def test_bench_attention_on_a_cpu_takes_the_reference_kernels_unless_told(tmp_path):
    """As the engine resolves its kernels: Triton on CUDA, the PyTorch references on a CPU (where Triton would need
    its interpreter). The smoke test that its refusal on a CPU offers, ``--device cpu --tiny``, runs as it is written."""
    args = parse("--tiny", "--device", "cpu", "--lengths", "1k", "--output", str(tmp_path))
    assert args.kernels is None and args.func(args) == 0
    assert json.loads((tmp_path / "attention.json").read_text())["args"]["kernels"] == "torch"

#!/usr/bin/env bash
# Tensor parallel on 2 GPUs (issue #32): the Llama-3-8B shape (random weights: speed does not depend on their values)
# at 1M tokens on one GPU beside 2 GPUs at 1M and 2M, TokenSelect with every decode step selecting (theta=null: no
# Selection Cache, so each step runs the vote in every layer and, with 2 ranks, its all-reduce), fp8 KV with the
# values in pinned host memory (what fits 1M tokens on one 80 GB GPU; the same for every row, so the rows compare).
# One device call on a 2-GPU machine (kind nvidia-h100-x2), about 8 minutes; if it runs short of time, run the parts
# one per call (tp1, then tp2, then table: each part leaves its JSON in OUTDIR).
# Usage: benchmarks/gpu_tensor_parallel.sh OUTDIR [all|smoke|tp1|tp2|tp2_2m|tp2local|table]   (smoke: the shipped model on both
#   GPUs against one, greedy tokens compared, under a minute; tp2local: 2 GPUs at 1M with rank-local selection
#   (--tp-selection local: no vote all-reduce), what the exact global vote costs; tp2_2m: tp2's 2M row alone;
#   all: every part but tp2_2m, then the table)
# Writes OUTDIR/e2e_tp1_1m_GPU.{md,json}, OUTDIR/e2e_tp2_GPU.{md,json}, OUTDIR/e2e_tp2_local_GPU.{md,json} and
# OUTDIR/tensor_parallel_GPU.md (GPU: h100 or h200, from nvidia-smi):
#   | GPUs | selection | tokens | prefill s | decode ms/token | peak GB per GPU |
# (peak GB: torch's peak allocation on rank 0's GPU; the ranks hold equal shares of weights and KV; NCCL's own
# buffers are not counted).
set -uo pipefail  # a part that fails or outlasts its timeout leaves the next parts to run
out=${1:?usage: benchmarks/gpu_tensor_parallel.sh OUTDIR [all|smoke|tp1|tp2|tp2_2m|tp2local|table]}
part=${2:-all}
mkdir -p "$out"
e2e=(python3 -m tokenselect.cli bench e2e --config llama3-8b --decode-steps 16 --kv-dtype fp8 --kv-offload values
     --policies "tokenselect:theta=null" --output "$out")
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$out/tensor_parallel_gpus.csv" || true
gpu=${TP_GPU:-$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -q H200 && echo h200 || echo h100)}  # TP_GPU: the table of runs copied from elsewhere
if [[ $part == all || $part == smoke ]]; then  # about a minute: both ranks on the GPUs, NCCL inside CUDA graphs
  timeout 300 python3 - <<'PY' 2>&1 | tee "$out/tensor_parallel_smoke.log"
import time
import torch
from tokenselect import LLM, SamplingParams
from tokenselect.bench.e2e import text_prompt

ids = text_prompt(8192, None)  # prose, the shipped model's tokenizer (its window is 1K: TokenSelect selects)
params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
runs, logits = {}, {}
for dtype in ("float32", "bfloat16"):
    for tp in (1, 2):
        start = time.perf_counter()
        llm = LLM(None, "tokenselect", dtype=dtype, k=128, n_init=16, n_local=64, dense_until=0,
                  tensor_parallel_size=tp)
        out = llm.generate([ids], params)[0]
        runs[dtype, tp] = out
        logits[dtype, tp] = llm.prompt_logits(ids)[-1024:].float().cpu()  # the rows where TokenSelect selects
        whole = getattr(llm.runner.graphs, "whole_steps", None)
        closing = time.perf_counter()
        llm.close()
        print(f"{dtype} TP={tp}: {closing - start:.1f} s (closed in {time.perf_counter() - closing:.1f} s), "
              f"whole-step graphs {whole}, tokens {out.token_ids}", flush=True)
    one, two = runs[dtype, 1], runs[dtype, 2]
    same = next((i for i, (a, b) in enumerate(zip(one.token_ids, two.token_ids)) if a != b), len(one.token_ids))
    a, b = logits[dtype, 1], logits[dtype, 2]
    print(f"{dtype}: TP=2 equals TP=1 for the first {same} of {len(one.token_ids)} greedy tokens; over the prompt's "
          f"last 1024 rows the logits differ by at most {(a - b).abs().max():.2e} (largest logit "
          f"{a.abs().max():.1f}) and the argmax agrees on {(a.argmax(-1) == b.argmax(-1)).float().mean():.1%}",
          flush=True)
PY
fi
if [[ $part == all || $part == tp1 ]]; then
  timeout 300 "${e2e[@]}" --lengths 1m --tag tp1_1m_$gpu 2>&1 | tee "$out/tp1.log" | tail -5
fi
if [[ $part == all || $part == tp2 ]]; then
  timeout 420 "${e2e[@]}" --lengths 1m,2m --tensor-parallel-size 2 --tag tp2_$gpu 2>&1 | tee "$out/tp2.log" | tail -5
fi
if [[ $part == tp2_2m ]]; then  # the 2M row alone (a run of tp2 whose 2M row failed)
  timeout 330 "${e2e[@]}" --lengths 2m --tensor-parallel-size 2 --tag tp2_2m_$gpu 2>&1 | tee "$out/tp2_2m.log" | tail -5
fi
if [[ $part == all || $part == tp2local ]]; then
  timeout 240 "${e2e[@]}" --lengths 1m --tensor-parallel-size 2 --tp-selection local --tag tp2_local_$gpu 2>&1 \
    | tee "$out/tp2_local.log" | tail -5
fi
python3 - "$out" "$gpu" <<'PY'
import json, sys
from pathlib import Path

out, gpu = Path(sys.argv[1]), sys.argv[2]
lines = ["# Tensor parallel: Llama-3-8B shape, TokenSelect (every decode step selecting), fp8 KV, V on host", "",
         "| GPUs | selection | tokens | prefill s | decode ms/token | peak GB per GPU |", "|---|---|---|---|---|---|"]
for name, gpus, selection in ((f"e2e_tp1_1m_{gpu}.json", 1, "-"), (f"e2e_tp2_{gpu}.json", 2, "global"),
                              (f"e2e_tp2_2m_{gpu}.json", 2, "global"), (f"e2e_tp2_local_{gpu}.json", 2, "local")):
    path = out / name
    if not path.exists() and "2m" in name:
        continue  # only where the tp2_2m part ran
    if not path.exists():
        lines.append(f"| {gpus} | {selection} | (not run: {name} missing) | | | |")
        continue
    data = json.loads(path.read_text())
    for r in data["rows"]:
        n = f"{r['length'] // 2**20}M" if r["length"] >= 2**20 else f"{r['length'] // 1024}K"
        if "error" in r:
            lines.append(f"| {gpus} | {selection} | {n} | {r['error']} | | |")
        else:
            peak = f"{r['peak_gb']:.1f}" if r.get("peak_gb") is not None else "-"
            lines.append(f"| {gpus} | {selection} | {n} | {r['prefill_s']:.1f} | {r['decode_ms']:.1f} | {peak} |")
lines.append("")
tp2 = out / f"e2e_tp2_{gpu}.json"
lines.append(f"On {json.loads(tp2.read_text())['device'] if tp2.exists() else '?'}.")
(out / f"tensor_parallel_{gpu}.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY

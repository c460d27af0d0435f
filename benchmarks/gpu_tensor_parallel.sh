#!/usr/bin/env bash
# Tensor parallel on 2 GPUs (issue #32): the Llama-3-8B shape (random weights: speed does not depend on their values)
# at 1M tokens on one GPU beside 2 GPUs at 1M and 2M, TokenSelect with every decode step selecting (theta=null: no
# Selection Cache, so each step runs the vote in every layer and, with 2 ranks, its all-reduce), fp8 KV with the
# values in pinned host memory (what fits 1M tokens on one 80 GB GPU; the same for every row, so the rows compare).
# One device call on a 2-GPU machine (kind nvidia-h100-x2), about 8 minutes; if it runs short of time, run the parts
# one per call (tp1, then tp2, then table: each part leaves its JSON in OUTDIR).
# Usage: benchmarks/gpu_tensor_parallel.sh OUTDIR [all|smoke|tp1|tp2|tp2local|table]   (smoke: the shipped model on both
#   GPUs against one, greedy tokens compared, under a minute; tp2local: 2 GPUs at 1M with rank-local selection
#   (--tp-selection local: no vote all-reduce), what the exact global vote costs; all: every part, then the table)
# Writes OUTDIR/e2e_tp1_1m_h100.{md,json}, OUTDIR/e2e_tp2_h100.{md,json}, OUTDIR/e2e_tp2_local_h100.{md,json} and
# OUTDIR/tensor_parallel_h100.md:
#   | GPUs | selection | tokens | prefill s | decode ms/token | peak GB per GPU |
# (peak GB: torch's peak allocation on rank 0's GPU; the ranks hold equal shares of weights and KV; NCCL's own
# buffers are not counted).
set -euo pipefail
out=${1:?usage: benchmarks/gpu_tensor_parallel.sh OUTDIR [all|smoke|tp1|tp2|table]}
part=${2:-all}
mkdir -p "$out"
e2e=(python3 -m tokenselect.cli bench e2e --config llama3-8b --decode-steps 16 --kv-dtype fp8 --kv-offload values
     --policies "tokenselect:theta=null" --output "$out")
nvidia-smi --query-gpu=index,name,memory.total --format=csv | tee "$out/tensor_parallel_gpus.csv" || true
if [[ $part == all || $part == smoke ]]; then  # under a minute: both ranks on the GPUs, NCCL inside CUDA graphs
  python3 - <<'PY' 2>&1 | tee "$out/tensor_parallel_smoke.log"
import time
from tokenselect import LLM, SamplingParams
from tokenselect.bench.e2e import text_prompt

ids = text_prompt(8192, None)  # prose, the shipped model's tokenizer (its window is 1K: TokenSelect selects)
params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
runs = {}
for tp in (1, 2):
    start = time.perf_counter()
    llm = LLM(None, "tokenselect", k=128, n_init=16, n_local=64, dense_until=0, tensor_parallel_size=tp)
    runs[tp] = llm.generate([ids], params)[0].token_ids
    print(f"TP={tp}: {time.perf_counter() - start:.1f} s, whole-step graphs {getattr(llm.runner.graphs, 'whole_steps', None)}, "
          f"tokens {runs[tp]}", flush=True)
    llm.close()
same = next((i for i, (a, b) in enumerate(zip(runs[1], runs[2])) if a != b), len(runs[1]))
print(f"TP=2 equals TP=1 for the first {same} of {len(runs[1])} greedy tokens (bf16: summation order may differ)")
PY
fi
if [[ $part == all || $part == tp1 ]]; then
  "${e2e[@]}" --lengths 1m --tag tp1_1m_h100 2>&1 | tee "$out/tp1.log" | tail -5
fi
if [[ $part == all || $part == tp2 ]]; then
  "${e2e[@]}" --lengths 1m,2m --tensor-parallel-size 2 --tag tp2_h100 2>&1 | tee "$out/tp2.log" | tail -5
fi
if [[ $part == all || $part == tp2local ]]; then
  "${e2e[@]}" --lengths 1m --tensor-parallel-size 2 --tp-selection local --tag tp2_local_h100 2>&1 \
    | tee "$out/tp2_local.log" | tail -5
fi
python3 - "$out" <<'PY'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
lines = ["# Tensor parallel: Llama-3-8B shape, TokenSelect (every decode step selecting), fp8 KV, V on host", "",
         "| GPUs | selection | tokens | prefill s | decode ms/token | peak GB per GPU |", "|---|---|---|---|---|---|"]
for name, gpus, selection in (("e2e_tp1_1m_h100.json", 1, "-"), ("e2e_tp2_h100.json", 2, "global"),
                              ("e2e_tp2_local_h100.json", 2, "local")):
    path = out / name
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
lines.append(f"On {json.loads((out / 'e2e_tp2_h100.json').read_text())['device'] if (out / 'e2e_tp2_h100.json').exists() else '?'}.")
(out / "tensor_parallel_h100.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY

#!/usr/bin/env bash
# The committed evaluation tables, regenerated on one GPU (a few minutes on an H100):
#   1. the shipped model on InfiniteBench retrieval and RULER single needles at 1x..64x its window,
#      for every policy of issue #7 (one process per policy, side by side, then merged);
#   2. what fp8 KV storage costs in accuracy: full and TokenSelect again on the same prompts, fp8 KV.
# Usage: benchmarks/gpu_eval.sh OUTDIR   (then copy OUTDIR/{policies,kv_fp8} tables and plots to benchmarks/results)
set -euo pipefail
out=${1:?usage: benchmarks/gpu_eval.sh OUTDIR}
export OMP_NUM_THREADS=2
tasks=${TASKS:-passkey,number_string,kv_retrieval,niah_single_1,niah_single_2,niah_single_3}
common=(--task $tasks --lengths ${LENGTHS:-1x,4x,16x,64x} --samples ${SAMPLES:-5} --kv-cache-tokens 400000)
policies=(full full@dynamic:4 streaming infllm reattention tokenselect)
mkdir -p "$out/runs"
for p in "${policies[@]}"; do
  python3 -m tokenselect.cli eval "${common[@]}" --attention "$p" --output "$out/runs/$p" >"$out/runs/$p.log" 2>&1 &
done
python3 -m tokenselect.cli eval "${common[@]}" --attention full,tokenselect --kv-dtype fp8 \
    --output "$out/kv_fp8" >"$out/kv_fp8.log" 2>&1 &
wait
python3 benchmarks/merge_eval.py "$out/policies" "${policies[@]/#/$out/runs/}"
cat "$out/kv_fp8/table.md"

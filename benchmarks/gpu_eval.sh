#!/usr/bin/env bash
# The committed evaluation tables, regenerated on one GPU (a few minutes on an H100):
#   policies    the shipped model on InfiniteBench retrieval and RULER single needles at 1x..64x its window,
#               for every policy of issue #7 (one process per policy, side by side, then merged);
#   kv_fp8      what fp8 KV storage costs in accuracy: full and TokenSelect again on the same prompts, fp8 KV;
#   select_fp8  what fp8 selection keys (--select-dtype fp8) cost: TokenSelect on the same prompts, scoring an fp8
#               copy of the keys, next to TokenSelect scoring the bf16 keys.
# Usage: benchmarks/gpu_eval.sh OUTDIR [PART ...]   (default: all three; then copy OUTDIR/{policies,kv_fp8,select_fp8}
# tables and plots to benchmarks/results). Each table.md ends with the Selection Cache's hit rate on these prompts.
set -euo pipefail
out=${1:?usage: benchmarks/gpu_eval.sh OUTDIR [policies] [kv_fp8] [select_fp8]}
shift
parts=${*:-policies kv_fp8 select_fp8}
export OMP_NUM_THREADS=2
tasks=${TASKS:-passkey,number_string,kv_retrieval,niah_single_1,niah_single_2,niah_single_3}
common=(--task $tasks --lengths ${LENGTHS:-1x,4x,16x,64x} --samples ${SAMPLES:-5} --kv-cache-tokens 400000)
policies=(full full@dynamic:4 streaming infllm reattention tokenselect)
mkdir -p "$out/runs"
eval_run() { python3 -m tokenselect.cli eval "${common[@]}" "$@"; }
for part in $parts; do
  case "$part" in
    policies) for p in "${policies[@]}"; do
                eval_run --attention "$p" --output "$out/runs/$p" >"$out/runs/$p.log" 2>&1 &
              done ;;
    kv_fp8) eval_run --attention full,tokenselect --kv-dtype fp8 --output "$out/kv_fp8" >"$out/kv_fp8.log" 2>&1 & ;;
    select_fp8) [[ $parts == *policies* ]] || eval_run --attention tokenselect --output "$out/runs/tokenselect" \
                  >"$out/runs/tokenselect.log" 2>&1 &
                eval_run --attention tokenselect --select-dtype fp8 --output "$out/runs/tokenselect_fp8_select" \
                  >"$out/runs/tokenselect_fp8_select.log" 2>&1 & ;;
    *) echo "unknown part $part: policies, kv_fp8 or select_fp8" >&2; exit 2 ;;
  esac
done
wait
[[ $parts == *policies* ]] && python3 benchmarks/merge_eval.py "$out/policies" "${policies[@]/#/$out/runs/}"
[[ $parts == *kv_fp8* ]] && cat "$out/kv_fp8/table.md"
if [[ $parts == *select_fp8* ]]; then
  python3 benchmarks/merge_eval.py "$out/select_fp8" "$out/runs/tokenselect" \
    "$out/runs/tokenselect_fp8_select=tokenselect-fp8-select"
fi

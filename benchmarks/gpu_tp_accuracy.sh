#!/usr/bin/env bash
# What rank-local votes cost in accuracy (issue #32): each selective policy on the real-model eval, tensor parallel
# over 3 GPUs with the exact global vote and with rank-local votes, beside one GPU, on the same prompts.
#
#   benchmarks/gpu_tp_accuracy.sh OUTDIR
#
# Needs a machine of 4 GPUs (the nvidia-h100-x4 kind): SmolLM2-135M-Instruct has 3 kv heads, so it splits over 3
# ranks (GPUs 0-2); the one-GPU runs share GPU 3. Every run starts at once (the model is small: the processes share
# the GPUs), each stopped at LIMIT seconds (default 420), keeping the samples it finished. The model must be in $TOKENSELECT_HOME
# (benchmarks/model_parts.sh carries it). Settings (environment): TASKS (default niah_single_1,niah_single_2),
# LENGTHS (default 4x), SAMPLES (default 20), POLICIES (default "tokenselect infllm quest reattention").
# Writes OUTDIR/tp_accuracy.tgz: the merged table (eval/), every run's predictions and log (runs/).
set -euo pipefail
dest=${1:?usage: benchmarks/gpu_tp_accuracy.sh OUTDIR}
out=$(mktemp -d)
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
common=(--model smollm2-135m-instruct --task "${TASKS:-niah_single_1,niah_single_2}" --lengths "${LENGTHS:-4x}"
        --samples "${SAMPLES:-20}" --chat off --kv-cache-tokens 80000 --max-num-seqs 1)
read -r -a policies <<< "${POLICIES:-tokenselect infllm quest reattention}"
mkdir -p "$out/runs"
python3 -m tokenselect.cli eval "${common[@]}" --prompts-only 2>&1 | tail -1
start=$SECONDS
names=()
for p in "${policies[@]}"; do
  for sel in global local; do
    name="${p}_tp3_${sel}"; names+=("$name")
    CUDA_VISIBLE_DEVICES=0,1,2 timeout -k 90 "${LIMIT:-420}" python3 -m tokenselect.cli eval "${common[@]}" --attention "$p" \
      --tensor-parallel-size 3 --tp-selection "$sel" --output "$out/runs/$name" >"$out/runs/$name.log" 2>&1 &
  done
  name="${p}_tp1"; names+=("$name")
  CUDA_VISIBLE_DEVICES=3 timeout -k 90 "${LIMIT:-420}" python3 -m tokenselect.cli eval "${common[@]}" --attention "$p" \
    --output "$out/runs/$name" >"$out/runs/$name.log" 2>&1 &
done
wait || true
echo "eval: $((SECONDS - start)) s"
runs=()
for name in "${names[@]}"; do
  if [ -f "$out/runs/$name/summary.json" ]; then runs+=("$out/runs/$name=$name"); else echo "no results: $name"; fi
done
python3 benchmarks/merge_eval.py "$out/eval" "${runs[@]}" || true
mkdir -p "$dest" && tar czf "$dest/tp_accuracy.tgz" -C "$out" eval runs

#!/usr/bin/env bash
# What rank-local votes cost in accuracy (issue #32): each selective policy on the real-model eval, tensor parallel
# over 3 GPUs with the exact global vote and with rank-local votes, beside one GPU, on the same prompts.
#
#   benchmarks/gpu_tp_accuracy.sh OUTDIR
#
# Needs a machine of 4 GPUs (the nvidia-h100-x4 kind): SmolLM2-135M-Instruct has 3 kv heads, so it splits over 3
# ranks (GPUs 0-2), one engine at a time, each stopped at TP_LIMIT seconds (default LIMIT); the one-GPU runs share
# GPU 3 side by side, each stopped at LIMIT seconds (default 420). A stopped run keeps the samples it finished.
# The model must be in $TOKENSELECT_HOME (benchmarks/model_parts.sh carries it). Settings (environment): TASKS (default niah_single_1,niah_single_2),
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
for p in "${policies[@]}"; do  # the one-GPU runs side by side on GPU 3
  name="${p}_tp1"; names+=("$name")
  CUDA_VISIBLE_DEVICES=3 timeout -k 90 "${LIMIT:-420}" python3 -m tokenselect.cli eval "${common[@]}" --attention "$p" \
    --output "$out/runs/$name" >"$out/runs/$name.log" 2>&1 &
done
# the 3-GPU engines one at a time: NCCL ranks of several engines sharing GPUs spin waiting for peers that the other
# processes' time slices keep off their GPU (783 s a sample when 8 engines ran at once)
for p in "${policies[@]}"; do
  for sel in global local; do
    name="${p}_tp3_${sel}"; names+=("$name")
    CUDA_VISIBLE_DEVICES=0,1,2 timeout -k 90 "${TP_LIMIT:-${LIMIT:-420}}" python3 -m tokenselect.cli eval "${common[@]}" \
      --attention "$p" --tensor-parallel-size 3 --tp-selection "$sel" --output "$out/runs/$name" \
      >"$out/runs/$name.log" 2>&1 || true  # stopped (130) or failed: the next run still goes
  done
done
wait || true
echo "eval: $((SECONDS - start)) s"
runs=()
for name in "${names[@]}"; do
  if [ -s "$out/runs/$name/predictions.jsonl" ]; then runs+=("$out/runs/$name=$name"); else echo "no results: $name"; fi
done
python3 benchmarks/merge_eval.py "$out/eval" "${runs[@]}" || true
mkdir -p "$dest" && tar czf "$dest/tp_accuracy.tgz" -C "$out" eval runs

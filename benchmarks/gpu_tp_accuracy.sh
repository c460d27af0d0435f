#!/usr/bin/env bash
# What rank-local votes cost in accuracy (issue #32): each selective policy on the real-model eval, tensor parallel
# over TP GPUs with the exact global vote and with rank-local votes, beside one GPU, on the same prompts.
#
#   benchmarks/gpu_tp_accuracy.sh OUTDIR
#
# The TP-rank engines run one at a time on GPUs 0..TP-1, each stopped at TP_LIMIT seconds (default LIMIT): NCCL
# ranks of several engines sharing GPUs spin waiting for peers that the other processes' time slices keep off their
# GPU (783 s a sample when 8 engines of 3 ranks ran at once). The one-GPU runs (TP1_POLICIES) go side by side on
# GPU TP when the machine has a spare one; on a machine of exactly TP GPUs they run first, spread over its GPUs,
# and the TP runs wait for them. Each is stopped at LIMIT seconds (default 420). A stopped run keeps the samples it
# finished. The model must be in $TOKENSELECT_HOME (benchmarks/model_parts.sh carries it).
#
# Settings (environment), with their defaults: MODEL (smollm2-135m-instruct: 3 kv heads, so TP=3 and a machine of
# 4 GPUs; qwen2.5-coder-0.5b-instruct has 2 kv heads: TP=2), TP (3), TASKS (niah_single_1,niah_single_2),
# LENGTHS (4x), SAMPLES (20), KV (80000 pool tokens), POLICIES ("tokenselect infllm quest reattention"),
# TP1_POLICIES (POLICIES; "" to run none, e.g. where an earlier run on the same prompts stands for them).
# Writes OUTDIR/tp_accuracy.tgz: the merged table (eval/), every run's predictions and log (runs/).
set -euo pipefail
dest=${1:?usage: benchmarks/gpu_tp_accuracy.sh OUTDIR}
out=$(mktemp -d)
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
tp=${TP:-3}
common=(--model "${MODEL:-smollm2-135m-instruct}" --task "${TASKS:-niah_single_1,niah_single_2}"
        --lengths "${LENGTHS:-4x}" --samples "${SAMPLES:-20}" --chat off --kv-cache-tokens "${KV:-80000}"
        --max-num-seqs 1)
read -r -a policies <<< "${POLICIES:-tokenselect infllm quest reattention}"
read -r -a tp1_policies <<< "${TP1_POLICIES-${policies[*]}}"
gpus=$(nvidia-smi -L | wc -l)
((gpus >= tp)) || { echo "TP=$tp needs $tp GPUs, the machine has $gpus" >&2; exit 2; }
mkdir -p "$out/runs"
python3 -m tokenselect.cli eval "${common[@]}" --prompts-only 2>&1 | tail -1
start=$SECONDS
names=()
i=0
for p in "${tp1_policies[@]}"; do
  name="${p}_tp1"; names+=("$name")
  gpu=$((gpus > tp ? tp : i % gpus)); i=$((i + 1))
  CUDA_VISIBLE_DEVICES=$gpu timeout -k 90 "${LIMIT:-420}" python3 -m tokenselect.cli eval "${common[@]}" \
    --attention "$p" --output "$out/runs/$name" >"$out/runs/$name.log" 2>&1 &
done
if ((gpus == tp)); then wait || true; echo "one-GPU runs: $((SECONDS - start)) s"; fi
ranks=$(seq -s, 0 $((tp - 1)))
for p in "${policies[@]}"; do
  for sel in global local; do
    name="${p}_tp${tp}_${sel}"; names+=("$name")
    t0=$SECONDS
    CUDA_VISIBLE_DEVICES=$ranks timeout -k 90 "${TP_LIMIT:-${LIMIT:-420}}" python3 -m tokenselect.cli eval \
      "${common[@]}" --attention "$p" --tensor-parallel-size "$tp" --tp-selection "$sel" \
      --output "$out/runs/$name" >"$out/runs/$name.log" 2>&1 || true  # stopped (124) or failed: the next still goes
    echo "$name: $((SECONDS - t0)) s"
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

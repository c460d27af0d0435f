#!/usr/bin/env bash
# Real-model accuracy tables on one GPU: every policy on the same prompts, one process per policy side by side,
# merged into one table with 95% intervals; then the within-window agreement and the Selection Cache's hit rates
# on prose (benchmarks/real_model_checks.py).
#
#   benchmarks/gpu_real_eval.sh OUTDIR [eval] [checks]
#
# Settings (environment): MODEL (default smollm2-135m-instruct; the model must be in $TOKENSELECT_HOME, see
# benchmarks/model_parts.sh for the GPU machine), TASKS, LENGTHS, SAMPLES (default 20), CHAT (on|off|auto),
# POLICIES (space separated; NAME[:key=value;...][@SCALING]), KV (pool tokens per process), SEQS (sequences
# at once per process, default 1: each prefill chunk then runs as one CUDA graph), LIMIT (seconds each process
# may take; one past it stops at its next step and keeps the samples it finished, which the table names),
# PER_TASK=1 (one process per policy and task instead of per policy), GPUS (spread the processes over this many
# GPUs, round robin; default all the machine has), GPU_FIRST (the first of them; default 0), RESUME_FROM (an earlier
# table's predictions.jsonl[.gz]: each run starts from its answers to the run's cells and generates only the rest,
# benchmarks/seed_resume.py). Everything lands in OUTDIR/eval.tgz (the merged table, plots, and every run's
# predictions and log).
set -euo pipefail
dest=${1:?usage: benchmarks/gpu_real_eval.sh OUTDIR [eval] [checks]}
shift
out=$(mktemp -d)  # work here; what is kept goes to OUTDIR as one tarball a part (a device call returns few files)
parts=${*:-eval checks}
export OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
model=${MODEL:-smollm2-135m-instruct}
tasks=${TASKS:-passkey,number_string,kv_retrieval,niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,vt}
read -r -a policies <<< "${POLICIES:-full full@dynamic:4 full@yarn:4 streaming infllm quest tokenselect reattention}"
read -r -a flags <<< "${FLAGS:-}"
common=(--model "$model" --task "$tasks" --lengths "${LENGTHS:-1x,2x,4x,8x}" --samples "${SAMPLES:-20}"
        --chat "${CHAT:-off}" --kv-cache-tokens "${KV:-300000}" --max-num-seqs "${SEQS:-1}")
mkdir -p "$out/runs"
for part in $parts; do
  case "$part" in
    eval)
      start=$SECONDS
      python3 -m tokenselect.cli eval "${common[@]}" --prompts-only 2>&1 | tail -2
      echo "prompts: $((SECONDS - start)) s"
      gpus=${GPUS:-$(nvidia-smi -L 2>/dev/null | wc -l)}; gpus=$((gpus > 0 ? gpus : 1))
      if [ "${PER_TASK:-0}" = 1 ]; then IFS=, read -r -a groups <<< "$tasks"; else groups=("$tasks"); fi
      names=(); i=0
      for p in "${policies[@]}"; do
        for t in "${groups[@]}"; do
          name=${p//[:;=@]/_}; [ ${#groups[@]} -gt 1 ] && name="${name}_$t"
          names+=("$name")
          run=("${common[@]}" "${flags[@]}" --task "$t" --attention "$p" --output "$out/runs/$name")
          if [ -n "${RESUME_FROM:-}" ]; then
            python3 benchmarks/seed_resume.py "$RESUME_FROM" -- "${run[@]}" && run+=(--resume)
          fi
          # SIGTERM at LIMIT: the run stops at its next step and writes what it finished; KILL a minute later
          CUDA_VISIBLE_DEVICES=$((${GPU_FIRST:-0} + i % gpus)) timeout -k 60 "${LIMIT:-0}" python3 -m tokenselect.cli eval \
            "${run[@]}" >"$out/runs/$name.log" 2>&1 &
          i=$((i + 1))
        done
      done
      wait
      echo "eval: $((SECONDS - start)) s"
      runs=()  # the runs that wrote their results (all, or what they finished within LIMIT seconds)
      for name in "${names[@]}"; do
        # a run killed before its summary still left a line per finished sample in predictions.jsonl
        if [ -s "$out/runs/$name/predictions.jsonl" ]; then runs+=("$out/runs/$name"); else echo "no results: $name"; fi
      done
      python3 benchmarks/merge_eval.py "$out/eval" "${runs[@]}" || true  # a failed run: the others still kept
      mkdir -p "$dest" && tar czf "$dest/eval.tgz" -C "$out" eval runs ;;
    checks)
      start=$SECONDS
      python3 benchmarks/real_model_checks.py --model "$model" --out "$dest/checks" ${KV:+--kv-cache-tokens "$KV"}
      echo "checks: $((SECONDS - start)) s" ;;
    *) echo "unknown part $part: eval or checks" >&2; exit 2 ;;
  esac
done

#!/usr/bin/env bash
# Needle selection recall (benchmarks/needle_recall.py, issue #27 item 4) for TokenSelect and variants of it, side by
# side on one GPU: each (variant, style) is its own process (the recorder runs the engine eagerly, host-bound, so
# the processes share the GPU well), each with a KV pool of its own size and a time limit; each process saves
# after every sample, so a cut-off run keeps what it measured.
#
# Usage (device): benchmarks/gpu_needle_recall.sh OUTDIR LENGTH DEPTHS [STYLES] [VARIANTS]
#   LENGTH   one length, e.g. 4x (of the model's window) or 32768
#   DEPTHS   needle depths per style (samples per cell), e.g. 20
#   STYLES   default ruler_essay,prose
#   VARIANTS space-separated, each "name:KEY=VALUE,KEY=VALUE" (policy=NAME picks the policy, TokenSelect if not
#            given; other keys are settings) or "name:" for TokenSelect's defaults; default:
#            default: k4096:k=4096 hard_vote:selector=hard_vote topk:selector=topk no_cache:theta=1.0 tail1:tail_chunk=1
# Env: MODEL (default smollm2-135m-instruct), LIMIT (seconds per process, default 480), KV (pool tokens, default
# 140000).
# Then (here): python benchmarks/needle_recall.py --summarize OUTDIR ... (see that script) or read each
# OUTDIR/<variant>-<style>/needle_recall.md.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: OUTDIR LENGTH DEPTHS [STYLES] [VARIANTS]}
length=${2:?LENGTH}
depths=${3:?DEPTHS}
styles=${4:-ruler_essay,prose}
variants=${5:-"default: k4096:k=4096 hard_vote:selector=hard_vote topk:selector=topk no_cache:theta=1.0 tail1:tail_chunk=1"}
mkdir -p "$out"
pids=()
for variant in $variants; do
  name=${variant%%:*}
  sets=()
  IFS=, read -ra pairs <<< "${variant#*:}"
  policy=(--policy tokenselect)
  for kv in "${pairs[@]}"; do
    if [[ $kv == policy=* ]]; then policy=(--policy "${kv#policy=}"); elif [[ -n $kv ]]; then sets+=(--set "$kv"); fi
  done
  for style in ${styles//,/ }; do
    dir="$out/$name-$style"
    mkdir -p "$dir"
    timeout "${LIMIT:-480}" python3 benchmarks/needle_recall.py --model "${MODEL:-smollm2-135m-instruct}" \
      --lengths "$length" --depths "$depths" --styles "$style" "${policy[@]}" --set "kv_cache_tokens=${KV:-140000}" "${sets[@]}" \
      --out "$dir" > "$dir/log.txt" 2>&1 &
    pids+=($!)
  done
done
for pid in "${pids[@]}"; do wait "$pid"; done
for f in "$out"/*/needle_recall.md; do echo "== $f"; sed -n 5,8p "$f"; done
tar -czf "$out.tgz" -C "$(dirname "$out")" "$(basename "$out")"  # one file: the device returns a few files a call

#!/usr/bin/env bash
# TokenSelect's prefill groups (the prefill_group setting) timed where they count: `bench e2e` at LENGTH, TokenSelect
# alone, in prefill chunks of each of CHUNKS tokens (the groups of 512 queries choosing as 512-token chunks would),
# the first chunk size again at the end (the GPU's drift shows as the spread between its two runs). The runs of
# PROFILE_CHUNK (if set) also profile two prefill chunks and two decode steps. Writes
# OUTDIR/e2e_groups_<length>_chunk<C>_<run>.{md,json}; prints each run's row.
# Usage: PYTHONPATH=$PWD [CHUNKS="512 2048 4096"] [PROFILE_CHUNK=2048] benchmarks/prefill_groups_gpu.sh OUTDIR
#        [LENGTH] [FLAG ...]   (FLAGs go to every run, e.g. --kv-dtype fp8 --kv-offload values at 1m)
set -euo pipefail
out=${1:?usage: benchmarks/prefill_groups_gpu.sh OUTDIR [LENGTH] [FLAG ...]}
length=${2:-128k}
shift $(($# < 2 ? $# : 2))
read -r -a chunks <<< "${CHUNKS:-512 2048 4096}"
runs=("${chunks[@]}" "${chunks[0]}")
for i in "${!runs[@]}"; do
  c=${runs[$i]}
  profile=()
  [[ $c == "${PROFILE_CHUNK:-}" && $i -lt ${#chunks[@]} ]] && profile=(--profile-steps 2)
  python3 -m tokenselect.cli bench e2e --lengths "$length" --policies tokenselect --decode-steps 16 --chunk-size "$c" \
    --output "$out" --tag "groups_${length}_chunk${c}_$i" "${profile[@]}" "$@"
done
grep -H "| tokenselect |" "$out"/e2e_groups_*.md

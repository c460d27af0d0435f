#!/usr/bin/env bash
# The scores kernel's tile timed where it counts: `bench e2e` at 128K, TokenSelect's selecting step, with the
# shipped tile and with TILE (e.g. 256,4,4,3, or several space-separated), alternated ROUNDS times in one call (the
# GPU's drift shows as the spread between rounds of one tile). Writes OUTDIR/tile_<tile>_<round>.{md,json}.
# PROFILE=1 also profiles two prefill chunks and two decode steps of each run (--profile-steps 2) and prints each
# run's scores-kernel line of its decode profile: the kernel's own time inside the step, for a tile that runs faster
# alone than in the step.
# TILE_OF=sparse_attention.CHUNK_TILE times the sparse attention kernel's chunk tile instead (any module of
# tokenselect.kernels and its tile tuple, read at each launch).
# E2E_ARGS adds flags to each run (e.g. "--kv-dtype fp8 --kv-offload values" at 1M).
# Usage: PYTHONPATH=$PWD [CONFIG=tiny] [PROFILE=1] [TILE_OF=module.NAME] [E2E_ARGS=...] benchmarks/scores_tile_e2e.sh
#        OUTDIR TILE [ROUNDS] [LENGTH]
set -euo pipefail
out=${1:?usage: benchmarks/scores_tile_e2e.sh OUTDIR TILE [ROUNDS] [LENGTH]}
tile=${2:?usage: benchmarks/scores_tile_e2e.sh OUTDIR TILE [ROUNDS] [LENGTH]}
rounds=${3:-2}
length=${4:-128k}
tile_of=${TILE_OF:-paged_dot.SCORES_TILE}
shipped=$(python3 -c "import importlib; t = getattr(importlib.import_module('tokenselect.kernels.${tile_of%.*}'), '${tile_of#*.}'); print(','.join(map(str, t)))")
for round in $(seq 1 "$rounds"); do
  for t in "$shipped" $tile; do
    python3 - "$tile_of" "$t" bench e2e --lengths "$length" --policies tokenselect --decode-steps 32 --output "$out" \
      --tag "tile_${t//,/_}_$round" --config "${CONFIG:-llama3-8b}" ${PROFILE:+--profile-steps 2} ${E2E_ARGS:-} <<'PY'
import importlib, runpy, sys
module, name = sys.argv[1].split(".")
# read at each launch (scores_block, sparse_attention)
setattr(importlib.import_module(f"tokenselect.kernels.{module}"), name, tuple(int(x) for x in sys.argv[2].split(",")))
sys.argv = ["tokenselect"] + sys.argv[3:]
runpy.run_module("tokenselect.cli", run_name="__main__")
PY
  done
done
grep -H "| tokenselect |" "$out"/e2e_tile_*.md
if [ -n "${PROFILE:-}" ]; then
  for f in "$out"/e2e_tile_*_profile.txt; do
    echo "$(basename "$f"): $(awk '/, decode$/{d=1} d && /_scores_kernel/{print; exit}' "$f" | tr -s ' ')"
  done
fi

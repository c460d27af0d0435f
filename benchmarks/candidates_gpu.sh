#!/usr/bin/env bash
# A change against the tree it replaces, on one GPU (the twenty-second session's: the top-k settled early, the mean
# query by a kernel, a chunk tile; merged as 164f229, 527eab6, 3986290): this tree against a commit packed with
# `benchmarks/before_after_e2e.sh pack COMMIT` and carried as .carry/before, in device calls of under 10 minutes:
#
#   benchmarks/candidates_gpu.sh kernels OUTDIR   the changed kernels' GPU tests; the top-k of both trees in CUDA
#                                                 graphs; a 1M chunk's kernels profiled in both trees and with the
#                                                 sparse attention's chunk tile (128, 64, 4, 3); `bench attention
#                                                 --fp8-select` of this tree, and its 1M row with that tile
#   benchmarks/candidates_gpu.sh e2e OUTDIR       the 1M selecting step and the 128K prefill, both trees back to back
#   benchmarks/candidates_gpu.sh totals OUTDIR    (the twenty-third session's head totals in parts, timed slower and
#                                                 dropped: results/supporting/head_totals_parts_h200.md) every kernel's GPU
#                                                 tests in 8 shards; head_vote_gpu.py of both trees and of this one
#                                                 at other TOTALS_TILE / TOTALS_PARTS; a 1M chunk's kernels profiled
#                                                 in both trees; `bench attention --fp8-select --lengths 1m` of this
#                                                 tree twice and of the packed one between; packed into totals.tgz
#   benchmarks/candidates_gpu.sh final OUTDIR     on the tree as committed: `bench attention --fp8-select` (its
#                                                 results/attention_h200.*), the mean kernel's column blocks, and the
#                                                 CUDA tests of gpu_tests.sh in 6 processes (no kernel shards: the
#                                                 changed kernels' GPU tests ran in the first call)
#
# Every step writes OUTDIR/<step>.log; a failed step is reported and the others still run. The device sends back
# at most 8 files: `final` packs everything into OUTDIR/final.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
step=${1:?usage: candidates_gpu.sh kernels|totals|e2e|final OUTDIR}
out=${2:?usage: candidates_gpu.sh kernels|totals|e2e|final OUTDIR}
mkdir -p "$out" && out=$(cd "$out" && pwd)
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
benchmarks/before_after_e2e.sh unpack
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv > "$out/gpu.txt" 2>&1
run() {  # name, command...: the command's output in OUTDIR/name.log, its tail on stdout
  local name=$1; shift
  local t0=$SECONDS
  "$@" > "$out/$name.log" 2>&1 || echo "STEP $name FAILED (rc $?)"
  echo "== $name ($((SECONDS - t0)) s)"; tail -n 4 "$out/$name.log"
}
tile=128,64,4,3
case $step in
  kernels)
    run kernel_tests python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py \
      -k "topk or query_mean or scores or vote or fold"
    run topk python3 benchmarks/topk_passes_gpu.py "$out/topk" .carry/before/tokenselect/kernels/topk.py
    run profile_after python3 benchmarks/attention_chunk_profile_gpu.py "$out/profile_after" --length 1m
    run profile_tile python3 benchmarks/attention_chunk_profile_gpu.py "$out/profile_tile" --length 1m \
      --chunk-tile $tile
    run profile_before env PYTHONPATH=/tmp/before:$PWD/benchmarks \
      python3 benchmarks/attention_chunk_profile_gpu.py "$out/profile_before" --length 1m
    run attention python3 -m tokenselect.cli bench attention --fp8-select --tag h200 --output "$out/attn"
    run attention_tile python3 - "$out/attn_tile" $tile <<'PY'
import importlib, sys
from unittest import mock
from tokenselect.cli import main
sparse = importlib.import_module("tokenselect.kernels.sparse_attention")
with mock.patch.object(sparse, "CHUNK_TILE", tuple(int(x) for x in sys.argv[2].split(","))):
    sys.exit(main(["bench", "attention", "--fp8-select", "--lengths", "1m", "--tag", "h200", "--output", sys.argv[1]]))
PY
    ;;
  totals)
    run kernel_tests env GRAPH_SHARDS=0 GPU_TESTS_LIMIT=300 benchmarks/gpu_tests.sh "$out/tests" 8
    run vote_after python3 benchmarks/head_vote_gpu.py "$out/vote" after
    run vote_before env PYTHONPATH=/tmp/before:$PWD/benchmarks python3 benchmarks/head_vote_gpu.py "$out/vote" before
    for variant in tile=2048,4 tile=1024,4 tile=2048,8 parts=4 parts=16; do
      run "vote_$variant" python3 - "$out/vote" "$variant" <<'PY'
import sys
from unittest import mock
import head_vote_gpu
from tokenselect.kernels import head_vote
key, value = sys.argv[2].split("=")
name, new = ("TOTALS_TILE", tuple(int(x) for x in value.split(","))) if key == "tile" else ("TOTALS_PARTS", int(value))
with mock.patch.object(head_vote, name, new):
    head_vote_gpu.main(sys.argv[1], sys.argv[2].replace(",", "x"))
PY
    done
    run profile_after python3 benchmarks/attention_chunk_profile_gpu.py "$out/profile_after" --length 1m
    run profile_before env PYTHONPATH=/tmp/before:$PWD/benchmarks \
      python3 benchmarks/attention_chunk_profile_gpu.py "$out/profile_before" --length 1m
    attention=(bench attention --fp8-select --lengths 1m --tag h200)
    run attention_1 python3 -m tokenselect.cli "${attention[@]}" --output "$out/attn_after_1"
    # `python3 -m` puts the working directory first on the path: the packed tree runs from its own
    run attention_before bash -c 'cd /tmp/before && PYTHONPATH=/tmp/before python3 -m tokenselect.cli "${@:2}" \
      --output "$1"' _ "$out/attn_before" "${attention[@]}"
    run attention_2 python3 -m tokenselect.cli "${attention[@]}" --output "$out/attn_after_2"
    tar czf "$out/totals.tgz" -C "$out" --exclude totals.tgz .
    ;;
  e2e)
    run ab1m env POLICIES=tokenselect STEPS=16 E2E_ARGS="--kv-dtype fp8 --kv-offload values" \
      benchmarks/before_after_e2e.sh run "$out/ab1m" 1m
    run ab128k env POLICIES=tokenselect,tokenselect:theta=-1 benchmarks/before_after_e2e.sh run "$out/ab128k" 128k
    ;;
  final)
    run attention python3 -m tokenselect.cli bench attention --fp8-select --tag h200 --output "$out/attn"
    run selection_query python3 benchmarks/selection_query_gpu.py "$out/selection_query"
    run gpu_tests env GRAPH_SHARDS=6 GPU_TESTS_LIMIT=${GPU_TESTS_LIMIT:-420} benchmarks/gpu_tests.sh "$out/tests" 0
    tar czf "$out/final.tgz" -C "$out" attn selection_query tests attention.log selection_query.log gpu_tests.log
    ;;
  *) echo "unknown step $step" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Issue #28's selection kernels, this tree against an earlier one on the same GPU in the same device call.
#
#   here:    benchmarks/before_after_e2e.sh pack COMMIT       (the earlier tree -> .carry/before)
#   device:  benchmarks/gpu_selection_speed.sh OUTDIR PART    (carry [".whl", ".carry/before"])
#
# PART:
#   kernels  the CUDA kernel tests of what the change touches (scores, vote, top-k, argmax); for each tree the top-k
#            against torch.topk (benchmarks/topk_gpu.py) and `tokenselect bench attention --fp8-select`; then this
#            tree's scores-kernel tile sweep over bf16 and fp8 keys (benchmarks/scores_tile_gpu.py; TILES=0: not it)
#                                                                          (about 8 minutes, 4 without the sweep)
#   e2e      the CUDA tests of the attended list's gather and of whole-step graphs (at most 200 s), then
#            `tokenselect bench e2e` at 128K, bf16 keys and fp8 selection keys: TokenSelect and its hit path for
#            both trees, and the dense baseline in this tree's run (the change does not touch dense's path)
#                                                                                          (about 9 minutes)
#   profile  this tree's per-part profile of the 128K decode step (benchmarks/gpu_e2e.sh profile), and an eager
#            128K TokenSelect decode under the profiler (aten ops named beside their kernels)  (about 3 minutes)
# Each step writes into OUTDIR as it goes, so a step cut short by the device's limit leaves the others.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:?usage: gpu_selection_speed.sh OUTDIR PART}")
part=${2:?usage: gpu_selection_speed.sh OUTDIR PART}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
export TOKENSELECT_HOME=/tmp/tshome
here=$PWD
benchmarks/before_after_e2e.sh unpack
each_tree() {  # each_tree NAME COMMAND...: COMMAND OUTDIR/<tree> with the earlier tree, then this one, run in that
  # tree's root (python -m imports from the working directory first)
  local name=$1; shift
  for tree in ${ORDER:-before after}; do  # ORDER="after before": this tree first
    local root=$here; [[ $tree == before ]] && root=/tmp/before
    mkdir -p "$out/$tree"
    echo "== $name ($tree) $(date +%T)"
    (cd "$root" && PYTHONPATH="/tmp/site:$root" "$@" "$out/$tree") > "$out/$tree/$name.log" 2>&1 \
      || echo "$name ($tree) failed"
    tail -4 "$out/$tree/$name.log"
  done
}
case "$part" in
  kernels)
    echo "== tests $(date +%T)"
    PYTHONPATH="/tmp/site:$here" python3 -m pytest -q tests/test_kernels.py -k "topk or paged_dot or soft_vote or \
      argmax or exact_dot or every_fp8 or every_pair" > "$out/kernel_tests.log" 2>&1
    tail -3 "$out/kernel_tests.log"
    each_tree topk python3 "$here/benchmarks/topk_gpu.py"
    attention() { python3 -m tokenselect.cli bench attention --fp8-select --tag h100 --output "$1"; }
    each_tree attention attention
    if [[ ${TILES:-1} == 1 ]]; then  # TILES=0: not the sweep
      echo "== tiles $(date +%T)"
      PYTHONPATH="/tmp/site:$here" python3 benchmarks/scores_tile_gpu.py "$out/after" > "$out/after/tiles.log" 2>&1
      tail -30 "$out/after/tiles.log"
    fi ;;
  e2e)
    if [[ ${TESTS:-1} == 1 ]]; then  # TESTS=0: not the tests
      echo "== tests $(date +%T)"  # the gather into the attended list, and whole-step graphs against eager steps
      PYTHONPATH="/tmp/site:$here" timeout 200 python3 -m pytest -q -x tests/test_kernels.py tests/test_whole_graphs.py \
        -k "gather_into or test_whole_graphs" > "$out/e2e_tests.log" 2>&1
      tail -3 "$out/e2e_tests.log"
    fi
    for keys in bf16 fp8; do
      select=(); [[ $keys == fp8 ]] && select=(--select-dtype fp8)
      e2e() {
        local policies=tokenselect,tokenselect:theta=-1; [[ $1 == */after ]] && policies=dense,$policies
        python3 -m tokenselect.cli bench e2e --lengths 128k --decode-steps 32 --policies "$policies" "${select[@]}" \
          --output "$1" --tag "128k_$keys"
      }
      each_tree "e2e_$keys" e2e
    done ;;
  profile)
    PYTHONPATH="/tmp/site:$here" benchmarks/gpu_e2e.sh "$out" profile
    echo "== eager profile $(date +%T)"
    PYTHONPATH="/tmp/site:$here" python3 -m tokenselect.cli bench e2e --lengths 128k --policies tokenselect \
      --no-cuda-graphs --decode-steps 4 --profile-steps 1 --output "$out" --tag eager_profile > "$out/eager.log" 2>&1
    tail -3 "$out/eager.log" ;;
  *) echo "unknown part $part: kernels, e2e or profile" >&2; exit 2 ;;
esac

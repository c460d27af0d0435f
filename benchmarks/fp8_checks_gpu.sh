#!/usr/bin/env bash
# What the thirty-third session left for a GPU (no device was lent after it was written), in one device call of
# about 4 minutes:
#   1. the peak-memory test of loading with fp8 weights (`tests/test_fp8_weights.py -k never_holds`);
#   2. the candidate benchmarks/candidates/fp8_quant_hardware_cast.patch: the shipped fp8_quant.py kept aside, the
#      patch applied to the tree, both timed side by side (`fp8_quant_gpu.py --other`, each checked byte for byte
#      against the reference), then the quantization and fp8 projection tests on the patched tree;
#   3. `bench e2e --lengths 128k --weight-dtype fp8` of TokenSelect and the dense runner on the patched tree, against
#      results/e2e_128k_weights_h200.md's 2.79 s (another machine: compare the prefill's GEMM share, not only its time).
#
#   benchmarks/fp8_checks_gpu.sh OUTDIR        -> OUTDIR/fp8_checks.tgz (every log and table)
#
# The patch changes the device's copy of the tree only. Every step writes OUTDIR/<step>.log; a failed step is
# reported and the others still run.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: benchmarks/fp8_checks_gpu.sh OUTDIR}
mkdir -p "$out" && out=$(cd "$out" && pwd)
export PYTHONPATH=$PWD:$PWD/benchmarks PYTHONUNBUFFERED=1
run() {  # name, command...: the command's output in OUTDIR/name.log, its tail on stdout
  local name=$1; shift
  local t0=$SECONDS
  "$@" > "$out/$name.log" 2>&1 || echo "STEP $name FAILED (rc $?)"
  echo "== $name ($((SECONDS - t0)) s)"; tail -n 4 "$out/$name.log"
}
run load_memory python3 -m pytest -q -rs tests/test_fp8_weights.py -k never_holds
cp tokenselect/kernels/fp8_quant.py "$out/fp8_quant_shipped.py"
run apply git apply benchmarks/candidates/fp8_quant_hardware_cast.patch
run quant_timing python3 benchmarks/fp8_quant_gpu.py "$out/quant" --other "$out/fp8_quant_shipped.py"
run quant_tests python3 -m pytest -q tests/test_fp8_weights.py -k "quantize or linear or graphs"
run e2e python3 -m tokenselect.cli bench e2e --lengths 128k --decode-steps 8 --weight-dtype fp8 \
  --policies dense:chunk=8192,tokenselect --output "$out/e2e" --tag 128k_fp8_cast_h200
tar czf "$out/fp8_checks.tgz" -C "$out" --exclude fp8_checks.tgz .

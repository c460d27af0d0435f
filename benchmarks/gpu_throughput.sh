#!/usr/bin/env bash
# Serving throughput where attention, not the weights, sets the step time (issue #28), on one 80 GB GPU in one
# device call: Llama-3-8B shape (random weights), requests of 32K prompt tokens decoded together at batch sizes
# 1, 2, 4, 8, 16, 32, by the dense baseline (flash attention over contiguous caches, a decode step one CUDA graph),
# the engine's full attention, TokenSelect and TokenSelect on the Selection Cache's hit path (theta=-1); each
# ratio against the fastest dense row at its batch size. Every method gets the engine's default KV budget (85% of
# the GPU memory free after the weights): at 131 KB of bf16 KV a token that is about 13 requests of 32K + 120
# tokens on an 80 GB H100, so 16 and 32 are "does not fit" rows and 13 is measured as the largest that fits.
#
# First the two GPU tests of the batched dense decode (its flash graph against the reference, the one-sequence
# graph against SDPA): a baseline that fails them is not measured.
#
# Estimated time (not measured): about 4 minutes on an H100 - start and tokenizing the prose ~30 s, the two
# tests ~30 s; dense ~45 s (13 prefills of 32K at ~2 s, then 17 decode steps at each of 13, 8, 4, 2, 1 at
# 10-40 ms); the engine's full attention ~40 s (its warm-up, 13 prefills at ~2 s, decode at batch 13 outside the
# whole-step graphs, which hold at most 8 sequences); each TokenSelect row ~30 s (13 prefills at ~1.1 s). Well
# under the 8-minute limit of one call; with --kv-dtype fp8 twice the requests fit (about 26: allow 6 minutes).
#
# Usage: benchmarks/gpu_throughput.sh OUTDIR [FLAG ...]   (FLAGs go to `bench throughput`, e.g. --kv-dtype fp8
#   --tag 32k_fp8; a later --tag replaces the default 32k). Writes OUTDIR/throughput_<tag>.{md,json,png} after every
#   measurement, OUTDIR/throughput_tests.log and OUTDIR/throughput.log.
set -euo pipefail
out=${1:?usage: benchmarks/gpu_throughput.sh OUTDIR [FLAG ...]}
shift
mkdir -p "$out"
python3 -m pytest -q -rs tests/test_bench_throughput.py tests/test_bench_dense.py -k "flash_decode_graph or decode_graph_gives" \
  2>&1 | tee "$out/throughput_tests.log" | tail -5
python3 -m tokenselect.cli bench throughput --length 32k --batch-sizes 1,2,4,8,16,32 \
  --policies dense,full,tokenselect,tokenselect:theta=-1 --decode-steps 16 --output "$out" --tag 32k "$@" \
  2>&1 | tee "$out/throughput.log"

#!/usr/bin/env bash
# The committed end-to-end tables (issue #9), regenerated on one 80 GB GPU, one part per call so that each
# fits a 10-minute device command. Each part writes OUTDIR/e2e_<tag>.{md,json,png}; copy them to
# benchmarks/results, add the notes, then run benchmarks/update_readme.py.
# Usage: benchmarks/gpu_e2e.sh OUTDIR PART
#   decode the GPU tests of the decode graphs (graphs really captured and checked), then 128K: dense,
#          TokenSelect (every step selecting, and the hit path) and streaming, decode steps captured whole
#   profile  128K TokenSelect alone with 2 prefill chunks and 2 decode steps under torch.profiler
#          (writes e2e_128k_profile_h100_profile.txt: what a missed target is explained with)
#   128k   32K and 128K, every policy against dense, and the Selection Cache's hit path   (about 4 minutes)
#   512k   512K with an fp8 KV pool (51 GB with the weights; dense's bf16 cache does not fit): TokenSelect and
#          streaming, then the hit path (move e2e_512k_hit_h100.* to results/supporting)   (about 4 minutes)
#   1m     1M tokens: TokenSelect (every step selecting, and the hit path) and streaming  (about 8 minutes)
#   1m-infllm  InfLLM at 1M on its own (its PyTorch scoring is slow; may need longer than one call)
set -euo pipefail
out=${1:?usage: benchmarks/gpu_e2e.sh OUTDIR PART}
part=${2:?usage: benchmarks/gpu_e2e.sh OUTDIR PART}
e2e=(python3 -m tokenselect.cli bench e2e --decode-steps 32 --output "$out")
offload=(--kv-dtype fp8 --kv-offload values)
case "$part" in
  decode) python3 -m pytest -q -x tests/test_decode_graphs.py tests/test_step_graphs.py tests/test_selection_cache.py \
            tests/test_kernels.py -k "decode or graph or selection or soft_vote" 2>&1 | tail -15
          "${e2e[@]}" --lengths 128k --tag 128k_decodegraphs_h100 \
            --policies dense,tokenselect,tokenselect:theta=-1,streaming ;;
  profile) "${e2e[@]}" --lengths 128k --tag 128k_profile_h100 --policies tokenselect --profile-steps 2 ;;
  128k) "${e2e[@]}" --lengths 32k,128k --tag 128k_h100 \
          --policies dense,full,streaming,infllm,tokenselect,tokenselect:theta=-1 ;;
  512k) "${e2e[@]}" --lengths 512k --tag 512k_h100 --kv-dtype fp8 --decode-steps 16 --policies tokenselect,streaming
        "${e2e[@]}" --lengths 512k --tag 512k_hit_h100 --kv-dtype fp8 --decode-steps 16 --policies tokenselect:theta=-1 ;;
  1m) "${e2e[@]}" --lengths 1m --tag 1m_graphs_h100 "${offload[@]}" \
          --policies tokenselect:theta=-1,tokenselect,streaming ;;
  1m-infllm) "${e2e[@]}" --lengths 1m --tag 1m_infllm_h100 "${offload[@]}" --policies infllm ;;
  *) echo "unknown part $part: decode, profile, 128k, 512k, 1m or 1m-infllm" >&2; exit 2 ;;
esac

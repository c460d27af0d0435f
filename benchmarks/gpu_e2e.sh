#!/usr/bin/env bash
# The committed end-to-end tables (issue #9), regenerated on one 80 GB GPU, one part per call so that each
# fits a 10-minute device command. Each part writes OUTDIR/e2e_<tag>.{md,json,png}; copy them to
# benchmarks/results, add the notes, then run benchmarks/update_readme.py.
# Files are tagged with the GPU (below, "_h100" stands for the GPU's tag: _h200 on an H200).
# Usage: benchmarks/gpu_e2e.sh OUTDIR PART [FLAG ...]   (FLAGs go to every `bench e2e` of the part, e.g.
#   `profile --select-dtype fp8 --tag 128k_fp8_select_profile_h100`: a later --tag replaces the part's)
#   tests    the GPU tests of whole-step graphs (really captured and checked), offload, the Selection Cache, InfLLM,
#            the models and the dense baseline (its decode graph), and the kernel tests of the row copies (the KV write), the top-k, the live-prefix attention,
#            the Selection Cache's update, silu_mul and InfLLM's block scores (about 6 minutes on a fresh machine), then the
#            top-k timed against torch.topk + sort (benchmarks/topk_gpu.py); OUTDIR/tests.log as it goes
#   kernels-a, kernels-b  test_kernels.py in two halves (b: sparse attention and window mass), each about 8 minutes
#            on a fresh machine (Triton compiles a variant per shape); OUTDIR/kernels_{a,b}.log
#   decode   the decode tile of sparse attention swept at 2K, 32K and 128K keys against flash SDPA
#            (benchmarks/decode_attention_gpu.py: OUTDIR/decode_attention.{json,md}, about 1 minute)
#   profile  128K TokenSelect (every step selecting, and the hit path) with 2 prefill chunks and 2 decode steps
#            under torch.profiler (writes e2e_128k_profile_h100_profile.txt: what a missed target is explained with)
#   128k     32K and 128K, every policy against the baselines (dense in 512-token chunks, in 8192-token chunks and
#            in one pass, and Hugging Face transformers' SDPA), the Selection Cache's hit path, and the decode step
#            at SmolLM2-135M-Instruct's hit rate on the RULER tasks (27.4% at theta 0.9, eval_smollm2_h100.md)
#                                                                                          (about 6 minutes)
#   256k     256K, past where a linear fit of the 128K and 32K rows puts the crossover of TokenSelect's selecting
#            decode step and full attention (~180K): dense, full, TokenSelect and its hit path (about 4 minutes)
#   fp8-select  128K and 256K with fp8 selection keys (--select-dtype fp8: TokenSelect scores an fp8 copy of the bf16
#            keys): dense, TokenSelect and its hit path, a table of its own (its dense row is its own run's)
#                                                                                          (about 4 minutes)
#   512k     512K with an fp8 KV pool (dense's bf16 cache does not fit): TokenSelect, its hit path, streaming and
#            InfLLM                                                                        (about 3 minutes)
#   1m       1M tokens, fp8 KV with the values in host memory: TokenSelect and its hit path (about 3.5 minutes)
#   1m-more  1M tokens likewise: streaming and InfLLM                                      (about 4 minutes)
#   best-dense  the headline table's 128K and 32K rows (results/e2e_best_dense_<gpu>.md): every policy against
#            the dense runner in 512-token chunks, in 8192-token chunks and in one pass, and transformers, at 128K,
#            then 32K with streaming and InfLLM added; OUTDIR/e2e_{128k,32k}_best_dense_<gpu>.{md,json,log}
#                                                                              (about 6 minutes on an H200)
#   best-dense-256k  its 256K rows, four processes one after another (each run's JSON its own, merged below):
#            TokenSelect and its hit path, dense in 8192-token chunks, full, dense in one pass (16 decode steps);
#            OUTDIR/e2e_256k_{ts,dense8192,full,denseall}_best_dense_<gpu>.{md,json,log} (about 6 minutes)
#   best-dense-512k  its 512K rows (bf16 KV: 69 GB on an H200): TokenSelect and its hit path, then dense in
#            8192-token chunks (two passes of about 130 s: the plans' and the timed one); no full or one-pass row (the
#            call's limit); OUTDIR/e2e_512k_{dense8192,ts}_best_dense_<gpu>.{md,json,log} (about 6 minutes)
#   prefill-chunks  128K TokenSelect (every step selecting) prefilled in chunks of 2048 (the default: four groups of
#            512), 4096, 8192 and 2048 again (the machine's drift), each chunk's groups choosing as 512-token chunks
#            would; 8 decode steps; OUTDIR/e2e_128k_chunk<N>[_again]_<gpu>.{md,json,log}     (about 5 minutes)
#   fp8-weights  128K with the layers' matrices in fp8 (--weight-dtype fp8) and then in bf16, each run with its own
#            dense rows (8192-token chunks, full attention) beside TokenSelect and its hit path, merged into one table
#            whose every x is against the fastest dense of both; OUTDIR/e2e_128k_{fp8,bf16}_weights_<gpu>.{md,json,log},
#            e2e_128k_weights_<gpu>.{md,json,png} (WEIGHTS="fp8" or "bf16" runs one; about 4 minutes each)
#   best-dense-merge  (no GPU) those runs that exist -> e2e_best_dense_<gpu>.{md,json,png}, with the decode
#            step at SmolLM2's 27.4% hit rate
#   merge    (no GPU) those of OUTDIR's e2e_{128k,256k,512k,1m,1m_more}_h100.json that exist (a later file's row
#            replaces an earlier one) -> one table and plot, e2e_h100.{md,json,png}
set -euo pipefail
# the files' suffix names the GPU that measured them: h100, h200 (GPU_TAG=... to choose; a CPU: h100)
gpu=${GPU_TAG:-$( (nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || true) | head -1 | grep -io 'h[0-9]\+' | tr A-Z a-z || true)}
gpu=${gpu:-h100}
out=${1:?usage: benchmarks/gpu_e2e.sh OUTDIR PART}
mkdir -p "$out"  # (a part that tees its log there starts before the bench makes it)
part=${2:?usage: benchmarks/gpu_e2e.sh OUTDIR PART}
shift 2
e2e=(python3 -m tokenselect.cli bench e2e --decode-steps 32 --output "$out")
extra=("$@")
offload=(--kv-dtype fp8 --kv-offload values --decode-steps 16)
case "$part" in
  tests) python3 -m pytest -q -rs tests/test_whole_graphs.py tests/test_step_graphs.py tests/test_offload.py \
           tests/test_selection_cache.py tests/test_baselines.py tests/test_models.py tests/test_bench_dense.py \
           tests/test_kernels.py -k "row_copy or \
           scatter_rows or gather_and_scatter or topk or sparse_attention_over_a_live_prefix or selection_update or \
           silu_mul or block_scores or not test_kernels" 2>&1 | tee "$out/tests.log" | tail -15
         python3 benchmarks/topk_gpu.py "$out" ;;
  kernels-a) python3 -m pytest -q tests/test_kernels.py -k "not sparse_attention and not window_mass" 2>&1 \
               | tee "$out/kernels_a.log" | tail -15 ;;
  kernels-b) python3 -m pytest -q tests/test_kernels.py -k "sparse_attention or window_mass" 2>&1 \
               | tee "$out/kernels_b.log" | tail -15 ;;
  decode) python3 benchmarks/decode_attention_gpu.py "$out" ;;
  profile) "${e2e[@]}" --lengths 128k --tag 128k_profile_$gpu --policies tokenselect,tokenselect:theta=-1 \
             --profile-steps 2 "${extra[@]}" ;;
  128k) "${e2e[@]}" --lengths 32k,128k --tag 128k_$gpu --hit-rate 0.274 \
          --policies dense,dense:chunk=8192,dense:chunk=all,transformers,full,streaming,infllm,tokenselect,tokenselect:theta=-1 \
          "${extra[@]}" ;;
  256k) "${e2e[@]}" --lengths 256k --tag 256k_$gpu --policies dense,full,tokenselect,tokenselect:theta=-1 "${extra[@]}" ;;
  fp8-select) "${e2e[@]}" --lengths 128k,256k --tag fp8_select_$gpu --select-dtype fp8 --hit-rate 0.274 \
                --policies dense,dense:chunk=all,tokenselect,tokenselect:theta=-1 "${extra[@]}" ;;
  512k) "${e2e[@]}" --lengths 512k --tag 512k_$gpu --kv-dtype fp8 --decode-steps 16 \
          --policies tokenselect,tokenselect:theta=-1,streaming,infllm "${extra[@]}" ;;
  1m) "${e2e[@]}" --lengths 1m --tag 1m_$gpu "${offload[@]}" --policies tokenselect,tokenselect:theta=-1 "${extra[@]}" ;;
  prefill-chunks)
    for run in 2048 4096 8192 2048_again; do
      "${e2e[@]}" --decode-steps 8 --lengths 128k --chunk-size ${run%_again} --policies tokenselect \
        --tag 128k_chunk${run}_$gpu "${extra[@]}" 2>&1 | tee "$out/e2e_128k_chunk${run}_$gpu.log" || failed=1
    done
    exit ${failed:-0} ;;
  1m-more) "${e2e[@]}" --lengths 1m --tag 1m_more_$gpu "${offload[@]}" --policies streaming,infllm "${extra[@]}" ;;
  best-dense)
    for len in 128k 32k; do
      more=(); [[ $len == 32k ]] && more=(streaming infllm)
      policies=$(IFS=,; echo "dense,dense:chunk=8192,dense:chunk=all,transformers,full,${more[*]:+${more[*]},}"\
"tokenselect,tokenselect:theta=-1")
      "${e2e[@]}" --lengths $len --tag ${len}_best_dense_$gpu --hit-rate 0.274 --policies "$policies" "${extra[@]}" \
        2>&1 | tee "$out/e2e_${len}_best_dense_$gpu.log" || failed=1
    done
    exit ${failed:-0} ;;
  fp8-weights)
    for w in ${WEIGHTS:-fp8 bf16}; do
      flag=(); [[ $w == fp8 ]] && flag=(--weight-dtype fp8)
      "${e2e[@]}" --lengths 128k --tag 128k_${w}_weights_$gpu --hit-rate 0.274 "${flag[@]}" \
        --policies dense:chunk=8192,full,tokenselect,tokenselect:theta=-1 "${extra[@]}" \
        2>&1 | tee "$out/e2e_128k_${w}_weights_$gpu.log" || failed=1
    done
    runs=("$out"/e2e_128k_{fp8,bf16}_weights_$gpu.json)
    [[ -f ${runs[0]} && -f ${runs[1]} ]] && python3 -m tokenselect.cli bench e2e --merge "${runs[@]}" --output "$out" \
      --tag 128k_weights_$gpu --hit-rate 0.274
    exit ${failed:-0} ;;
  best-dense-256k)
    for run in ts:tokenselect,tokenselect:theta=-1 dense8192:dense:chunk=8192 full:full denseall:dense:chunk=all; do
      tag=256k_${run%%:*}_best_dense_$gpu
      "${e2e[@]}" --decode-steps 16 --lengths 256k --tag "$tag" --policies "${run#*:}" "${extra[@]}" 2>&1 \
        | tee "$out/e2e_$tag.log" || failed=1
    done
    exit ${failed:-0} ;;
  best-dense-512k)
    for run in ts:tokenselect,tokenselect:theta=-1 dense8192:dense:chunk=8192; do
      tag=512k_${run%%:*}_best_dense_$gpu
      "${e2e[@]}" --decode-steps 16 --lengths 512k --kv-dtype bf16 --tag "$tag" --policies "${run#*:}" "${extra[@]}" \
        > "$out/e2e_$tag.log" 2>&1 || failed=1
    done
    exit ${failed:-0} ;;
  best-dense-merge)
    runs=()
    for f in "$out"/e2e_{32k,128k}_best_dense_$gpu.json \
             "$out"/e2e_256k_{dense8192,denseall,full,ts}_best_dense_$gpu.json \
             "$out"/e2e_512k_{dense8192,ts}_best_dense_$gpu.json; do [[ -f $f ]] && runs+=("$f"); done
    "${e2e[@]}" --hit-rate 0.274 --tag best_dense_$gpu --merge "${runs[@]}" "${extra[@]}" ;;
  merge) runs=(); for f in "$out"/e2e_{128k,256k,512k,1m,1m_more}_"$gpu".json; do [[ -f $f ]] && runs+=("$f"); done
         "${e2e[@]}" --tag "$gpu" --merge "${runs[@]}" "${extra[@]}" ;;
  *) echo "unknown part $part: tests, kernels-a, kernels-b, decode, profile, 128k, 256k, fp8-select, 512k, 1m," \
          "1m-more, best-dense, best-dense-256k, best-dense-512k, prefill-chunks, best-dense-merge or merge" >&2
     exit 2 ;;
esac

#!/usr/bin/env bash
# Every test that needs a GPU, and every Triton kernel compiled for CUDA against its PyTorch reference, in one
# device command of at most 10 minutes (issue #34). Re-run it, and commit its summary, after any change that
# touches tokenselect/kernels/, runner.py, cuda_graphs.py or the attention path.
#
# Usage: benchmarks/gpu_tests.sh OUTDIR [SHARDS]
#   OUTDIR/gpu_tests.md    the summary (commit it as benchmarks/results/gpu_tests_<gpu>.md)
#   OUTDIR/<shard>.log     each shard's pytest output
#
# What runs, as SHARDS + 1 pytest processes side by side (Triton compiles one kernel variant per shape, on the
# CPU: one process compiles on one core, so the shards share the machine's cores; default SHARDS 4):
#   graphs   the tests that need CUDA itself: whole-step CUDA graphs really captured and replayed
#            (test_whole_graphs.py, test_step_graphs.py), the dense baseline's decode graph (test_bench_dense.py),
#            value offload through mapped host memory (test_offload.py), the Selection Cache and the boundary cases
#            on the device (test_selection_cache.py, test_boundaries.py), the engine's CUDA copies
#            (test_engine.py), the CLI settings (test_cli_settings.py), the models against transformers and over a
#            scrambled pool (test_models.py, test_precision.py), InfLLM and the baselines (test_baselines.py), prefix
#            reuse with CUDA graphs (test_prefix_cache.py, always a process of its own: graphs-test_prefix_cache),
#            a toy policy recorded into whole-step graphs (test_toy_policy.py), each policy's choice on hand-built
#            caches with the compiled kernels (test_policies.py), decode steps queued ahead of the host
#            (test_overlap_decode.py)
#   kernels-i  tests/test_kernels.py dealt round-robin into SHARDS parts: every kernel compiled by Triton for the
#            GPU against its reference on random ragged inputs, which on CUDA takes the paths that the CPU
#            interpreter never runs: the fast-math RoPE (angles reduced by fma, then the hardware's sin/cos, at
#            key positions up to 2.1M), the bf16 tensor-core dots of sparse attention and the scores, rms_norm's
#            hardware bf16 rounding, the split-K merge and the fp8 pools
# GPU_TESTS_SELECT="expr": pass -k "expr" to every shard (a quick partial run); GPU_TESTS_ALLOW_CPU=1: run on a
# machine without CUDA, the kernels in Triton's interpreter (to try the script itself, with GPU_TESTS_SELECT);
# GRAPH_SHARDS=N: deal the graphs shard's files into N processes (default 1). On a machine of several GPUs the
# processes are dealt over them, round robin, each GPU running its own one after another: two pytest processes on
# one GPU ran out of memory there (a test sizes its KV pool by the memory it finds free).
set -uo pipefail
set -f  # test ids hold [...]: never globs
out=${1:?usage: benchmarks/gpu_tests.sh OUTDIR [SHARDS]}
shards=${2:-4}
limit=${GPU_TESTS_LIMIT:-540}  # seconds each process may take: the device command's limit is 600
mkdir -p "$out"
cd "$(dirname "$0")/.."
python3 - <<'EOF' > "$out/env.txt" 2>&1
import os, subprocess, torch, triton
print("torch", torch.__version__, "triton", triton.__version__, "cuda", torch.version.cuda)
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "NO CUDA DEVICE")
# TREE_COMMIT: what the caller knows the tree to be; a device copy's git metadata may be older than its files,
# which "-dirty" then shows
print("commit", os.environ.get("TREE_COMMIT") or subprocess.run(["git", "describe", "--always", "--dirty"],
                                                                capture_output=True, text=True).stdout.strip()
      or "(no git)")
EOF
if python3 -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  export TRITON_INTERPRET=0
elif [[ ${GPU_TESTS_ALLOW_CPU:-0} == 1 ]]; then
  export TRITON_INTERPRET=1
else
  echo "no CUDA device: this script is for a GPU machine" | tee "$out/gpu_tests.md" >&2
  exit 2
fi
select=(); [[ -n ${GPU_TESTS_SELECT:-} ]] && select=(-k "$GPU_TESTS_SELECT")

graphs=(tests/test_whole_graphs.py tests/test_step_graphs.py tests/test_bench_dense.py tests/test_offload.py
        tests/test_selection_cache.py tests/test_boundaries.py tests/test_engine.py tests/test_cli_settings.py
        tests/test_models.py tests/test_precision.py tests/test_baselines.py
        tests/test_toy_policy.py tests/test_policies.py tests/test_overlap_decode.py)
# Graphs tests that get a process of their own: a CUDA graph capture that fails inside cuBLAS poisons its process's
# CUDA context, and every later test there fails on it. test_prefix_cache.py's capture failed so twice with six
# processes on one H200 (never alone: supporting/gpu_tests_a127343_h200.md); alone, a repeat shows only its own tests.
graphs_alone=(tests/test_prefix_cache.py)
python3 -m pytest -q --collect-only tests/test_kernels.py 2>/dev/null | grep '::' > "$out/kernel_ids.txt"
# GPU_TESTS_GPUS="0 1": run on these GPUs only (the others left to other work); default every GPU the machine has
read -r -a gpu_ids <<< "${GPU_TESTS_GPUS:-$(seq -s ' ' 0 $(($(nvidia-smi -L 2>/dev/null | wc -l) - 1)))}"
((${#gpu_ids[@]} > 0)) || gpu_ids=(0)
gpus=${#gpu_ids[@]}
graph_shards=${GRAPH_SHARDS:-1}
jobs=()  # NAME:ids-file, one pytest process each
for ((i = 0; i < graph_shards; i++)); do
  name=graphs; ((graph_shards > 1)) && name="graphs-$i"
  for ((j = i; j < ${#graphs[@]}; j += graph_shards)); do echo "${graphs[j]}"; done > "$out/$name.ids"
  jobs+=("$name")
done
for file in "${graphs_alone[@]}"; do
  name="graphs-$(basename "$file" .py)"
  echo "$file" > "$out/$name.ids"
  jobs+=("$name")
done
for ((i = 0; i < shards; i++)); do
  awk -v n="$shards" -v i="$i" 'NR % n == i' "$out/kernel_ids.txt" > "$out/kernels-$i.ids"
  jobs+=("kernels-$i")
done
run_job() {  # NAME GPU
  local ids; mapfile -t ids < "$out/$1.ids"  # one id a line: a parametrized id may hold spaces
  CUDA_VISIBLE_DEVICES=$2 timeout "$limit" python3 -m pytest -q -rfEs -p no:cacheprovider "${select[@]}" \
    "${ids[@]}" > "$out/$1.log" 2>&1
}
pids=()
if ((gpus == 1)); then  # every process side by side on the one GPU (the tests fit beside each other there)
  for name in "${jobs[@]}"; do run_job "$name" "${gpu_ids[0]}" & pids+=($!); done
else  # one process at a time on each GPU: a test that sizes its KV pool by the free memory must find it free
  for ((g = 0; g < gpus; g++)); do
    ( status=0; for ((j = g; j < ${#jobs[@]}; j += gpus)); do run_job "${jobs[j]}" "${gpu_ids[g]}" || status=1; done
      exit $status ) &
    pids+=($!)
  done
fi
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
set +f
shopt -s nullglob  # SHARDS 0: no kernel logs

{
  echo "# GPU tests"
  echo
  sed 's/^/    /' "$out/env.txt"
  echo
  if ((shards > 0)); then
    echo "\`benchmarks/gpu_tests.sh OUTDIR $shards\`: the GPU-only tests and every Triton kernel compiled for CUDA against"
    echo "its reference ($(wc -l < "$out/kernel_ids.txt") kernel test cases in $shards shards). Each shard's closing line:"
  else
    echo "\`benchmarks/gpu_tests.sh OUTDIR 0\`: the GPU-only tests; the kernel tests ($(wc -l < "$out/kernel_ids.txt") cases) not"
    echo "run. Each shard's closing line:"
  fi
  echo
  echo "| shard | result |"
  echo "| --- | --- |"
  for log in "$out"/graphs*.log "$out"/kernels-*.log; do
    name=$(basename "$log" .log)
    last=$(grep -E '(passed|failed|error|no tests ran|deselected)' "$log" | tail -1)
    [[ -z $last ]] && last="(no closing line: cut off by the ${limit}s limit?)"
    echo "| $name | $last |"
  done
  echo
  if grep -qE '^(FAILED|ERROR)' "$out"/*.log; then
    echo "## Failures"
    echo
    grep -hE '^(FAILED|ERROR)' "$out"/*.log | sed 's/^/    /'
    echo
  fi
  if grep -qE '^SKIPPED' "$out"/*.log; then
    echo "## Skipped"
    echo
    grep -hE '^SKIPPED' "$out"/*.log | sed 's/^/    /'
  fi
} > "$out/gpu_tests.md"
cat "$out/gpu_tests.md"
exit $status

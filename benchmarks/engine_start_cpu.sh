#!/usr/bin/env bash
# An engine's start on a GGUF model, step by step, before and after the saved tokenizer and the eval's one GGUF read
# (benchmarks/engine_start_gpu.py), on this machine's CPU: the tree of BEFORE (default e7ee472, whose tokenselect/ is
# 7bc555b's) beside this one, with the saved tokenizer removed first (a first start) and kept (every later start).
#
#   benchmarks/engine_start_cpu.sh OUT.md [MODEL] [BEFORE]
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(realpath -m "${1:?usage: engine_start_cpu.sh OUT.md [MODEL] [BEFORE]}")
model=${2:-qwen2.5-coder-0.5b-instruct}
before=${3:-e7ee472}
tree=$(mktemp -d)
git worktree add -q --detach "$tree" "$before"
trap 'git worktree remove --force "$tree"' EXIT
run() {  # TITLE ROOT ARGS...: the script of ROOT's tree, importing that tree's package
  local title=$1 root=$2; shift 2
  printf '\n## %s\n\n```\n' "$title"
  (cd "$root" && PYTHONPATH="$root" CUDA_VISIBLE_DEVICES= python3 benchmarks/engine_start_gpu.py "$model" quest 20000 \
    "$@" 2>/dev/null | grep -E '^ +[0-9.]+ s')
  printf '```\n'
}
{
  printf '# Engine start on %s, %s (CPU, %s cores)\n\nCommand: `benchmarks/engine_start_cpu.sh %s %s %s`' \
    "$model" "$(git rev-parse --short HEAD)" "$(nproc)" "$1" "$model" "$before"
  printf ' (seconds since the script started; the tokenizer line times `Checkpoint.tokenizer()` alone, then the\n'
  printf 'engine is started: at %s it reads the GGUF and builds the tokenizer again, here it takes the open checkpoint).\n' "$before"
  run "before ($before): the tokenizer converted from the GGUF every time" "$tree"
  run "after, first start (--fresh: the saved tokenizer removed)" "$PWD" --fresh
  run "after, a later start (the saved tokenizer loaded)" "$PWD"
} > "$out"
cat "$out"

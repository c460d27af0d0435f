#!/usr/bin/env bash
# The end-to-end bench of two trees in one device call, same GPU, back to back: a change that must not slow the
# engine down (issue #29's refactor, say) is shown beside the tree it replaces.
#
#   here:    benchmarks/before_after_e2e.sh pack COMMIT        -> .carry/before/ (that commit's tokenselect/,
#                                                                 without the 34 MB embedded model)
#   device:  benchmarks/before_after_e2e.sh unpack                -> /tmp/before (what run does first; other scripts
#                                                                 that time the packed tree call it too)
#            benchmarks/before_after_e2e.sh run OUTDIR [LENGTHS] -> OUTDIR/before_after.md and both runs' JSON
#            (TREE_COMMIT=<commit> names the current tree in the table; else git describe --dirty)
#            benchmarks/before_after_e2e.sh both OUTDIR [LENGTHS] -> run in each order: OUTDIR/first (before, then
#                                                                 after) and OUTDIR/swapped (ORDER="after before")
#            (carry [".carry/before"]; the embedded model of the current tree serves both)
# Each tree runs `tokenselect bench e2e` at LENGTHS (default 128k) with dense, full, streaming, infllm, tokenselect and
# TokenSelect's hit path (tokenselect:theta=-1) (or POLICIES), 32 decode steps (STEPS), with E2E_ARGS added (e.g. "--config tiny" to
# try it on a CPU): about 3 minutes a tree at 128K on an H100. ORDER="after before" runs the current tree first: a
# second run in that order tells a tree's difference from the order's (a warmer GPU, a cache already filled).
set -euo pipefail
cd "$(dirname "$0")/.."
unpack() {  # (device) the packed tree -> /tmp/before, sharing this tree's embedded model
  rm -rf /tmp/before && mkdir -p /tmp/before && cp -r .carry/before/tokenselect /tmp/before/
  ln -s "$PWD/tokenselect/data" /tmp/before/tokenselect/data
}
case "${1:-}" in
  pack)
    commit=${2:?commit}
    rm -rf .carry/before && mkdir -p .carry/before
    git archive "$commit" tokenselect | tar -x -C .carry/before --exclude tokenselect/data
    echo "$commit" > .carry/before/COMMIT
    du -sh .carry/before ;;
  unpack) unpack ;;
  both)
    out=${2:?usage: both OUTDIR [LENGTHS]}
    "$0" run "$out/first" "${@:3}"
    ORDER="after before" "$0" run "$out/swapped" "${@:3}" ;;
  run)
    out=${2:?usage: run OUTDIR [LENGTHS]}
    lengths=${3:-128k}
    mkdir -p "$out"
    unpack
    policies=${POLICIES:-dense,full,streaming,infllm,tokenselect,tokenselect:theta=-1}
    for tree in ${ORDER:-before after}; do
      root=$PWD; [[ $tree == before ]] && root=/tmp/before
      (cd "$root" && PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" python3 -m tokenselect.cli bench e2e \
         --lengths "$lengths" --policies "$policies" --decode-steps "${STEPS:-32}" --output "$out" --tag "$tree" ${E2E_ARGS:-}) \
        > "$out/$tree.log" 2>&1 || echo "$tree failed: see $out/$tree.log"
    done
    python3 - "$out" "$(cat .carry/before/COMMIT)" "${TREE_COMMIT:-$(git describe --always --dirty 2>/dev/null || echo worktree)}" <<'PY'
import json, sys
from pathlib import Path
out, before_commit, after_commit = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
runs = {tree: {(r["length"], r["policy"]): r for r in json.loads((out / f"e2e_{tree}.json").read_text())["rows"]}
        for tree in ("before", "after") if (out / f"e2e_{tree}.json").exists()}
lines = [f"# End to end before and after: {before_commit} -> {after_commit}, same GPU, back to back", "",
         "| length | policy | prefill s before | after | decode ms before | after | decode after/before |",
         "|---|---|---|---|---|---|---|"]
for key in runs.get("before", {}):
    b, a = runs["before"][key], runs.get("after", {}).get(key)
    if a is None:
        lines.append(f"| {key[0] // 1024}K | {key[1]} | {b['prefill_s']:.2f} | — | {b['decode_ms']:.2f} | — | — |")
        continue
    lines.append(f"| {key[0] // 1024}K | {key[1]} | {b['prefill_s']:.2f} | {a['prefill_s']:.2f} | "
                 f"{b['decode_ms']:.2f} | {a['decode_ms']:.2f} | {a['decode_ms'] / b['decode_ms']:.3f} |")
(out / "before_after.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY
    ;;
  *) echo "usage: benchmarks/before_after_e2e.sh pack COMMIT | unpack | run OUTDIR [LENGTHS]" >&2; exit 2 ;;
esac

#!/usr/bin/env bash
# Decode steps of several trees on one machine, one after another: `bench e2e` at 128K (TokenSelect selecting and
# on its hit path) and 8 x 32K batched (batch_decode_profile_gpu.py, no profile), for each NAME=DIR of TREES, in
# that order. A variant of the kernels is measured beside the tree it would replace without any switch in the
# product: pack each variant's tokenselect/ into a folder under .carry/ and carry it.
#
#   device: TREES="before=/tmp/before after=. b=.carry/b" benchmarks/trees_decode_gpu.sh OUTDIR
#           (before_after_e2e.sh unpack first for /tmp/before) -> OUTDIR/trees_decode.md and each run's files
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:?usage: TREES="name=dir ..." benchmarks/trees_decode_gpu.sh OUTDIR}
mkdir -p "$out"
here=$PWD
for pair in ${TREES:?TREES="name=dir ..."}; do
  name=${pair%%=*}; dir=$(cd "${pair#*=}" && pwd)
  [[ -e $dir/tokenselect/data ]] || ln -s "$here/tokenselect/data" "$dir/tokenselect/data"
  (cd "$dir" && PYTHONPATH="$dir" python3 -m tokenselect.cli bench e2e --lengths 128k \
     --policies tokenselect,tokenselect:theta=-1 --decode-steps 32 --output "$out" --tag "$name") \
    > "$out/e2e_$name.log" 2>&1 || echo "$name: bench e2e failed (see $out/e2e_$name.log)"
  PYTHONPATH="$dir" python3 benchmarks/batch_decode_profile_gpu.py "$out/batch_$name" --no-single \
    --profile-steps "${PROFILE_STEPS:-0}" > "$out/batch_$name.log" 2>&1 || echo "$name: batch failed"
done
python3 - "$out" $TREES <<'PY'
import json, sys
from pathlib import Path
out, names = Path(sys.argv[1]), [p.split("=")[0] for p in sys.argv[2:]]
lines = ["# Decode ms a step by tree, same GPU, one after another", "",
         "| tree | 128K selecting | 128K hit | 8 x 32K selecting | 8 x 32K hit |", "|---|---|---|---|---|"]
for name in names:
    cells = []
    e2e = out / f"e2e_{name}.json"
    rows = {r["policy"]: r for r in json.loads(e2e.read_text())["rows"]} if e2e.exists() else {}
    cells += [f"{rows[p]['decode_ms']:.2f}" if p in rows else "-" for p in ("tokenselect", "tokenselect:theta=-1")]
    batch = out / f"batch_{name}" / "batch_decode_profile.json"
    rows = {r["policy"]: r for r in json.loads(batch.read_text())["rows"]} if batch.exists() else {}
    cells += [f"{rows[p]['ms_step']:.2f}" if p in rows else "-" for p in ("tokenselect", "tokenselect:theta=-1")]
    lines.append(f"| {name} | " + " | ".join(cells) + " |")
(out / "trees_decode.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY

#!/usr/bin/env bash
# Carry registry models to the GPU machine, whose calls take at most 64 MiB of working tree each: each GGUF goes in
# parts, one part a call, the calls back to back while the machine is warm (its /tmp lasts while it stays warm).
#
#   here:    benchmarks/model_parts.sh split NAME [BYTES]  -> .carry/parts/NAME/part00 .. partNN
#   device:  benchmarks/model_parts.sh receive NAME        -> the carried part(s) of NAME into /tmp/model_parts/NAME/
#   device:  benchmarks/model_parts.sh assemble NAME       -> $TOKENSELECT_HOME/models/NAME/FILE, size and sha256 checked
#   here:    benchmarks/model_parts.sh wheels                -> .carry/whl/: the wheels of what the device lacks for a
#            real model's run (gguf, to read a GGUF; wonderwords, the eval's needle tasks), no dependencies (~0.4 MB)
#   device:  benchmarks/model_parts.sh install-wheels        -> those wheels into /tmp/site (then PYTHONPATH=$PWD:/tmp/site)
#
# BYTES (default 18,000,000) plus the rest of the tree must stay under 64 MiB: with the tree as it is (~47 MB, of
# which 31 MB are the embedded model's safetensors) parts of 18 MB fit; with the embedded model moved out of the
# working tree for the carrying calls (benchmarks/embedded_model.sh away, then back), parts of 49,200,000 bytes fit
# beside the wheels. SmolLM2 (98 MB) is then 2 parts, Qwen2.5-Coder-0.5B (491 MB) 10.
#
# Call sequence (each a `run` with carry [".carry/parts/NAME/partNN"], the next issued as soon as one returns):
#   1 .. N-1:  benchmarks/model_parts.sh receive NAME
#   N:         benchmarks/model_parts.sh receive NAME && benchmarks/model_parts.sh assemble NAME &&
#              benchmarks/model_parts.sh install-wheels && PYTHONPATH=$PWD:/tmp/site <the work>
#              (carry [".carry/parts/NAME/partNN", ".carry/whl"] in that last call)
# with TOKENSELECT_HOME=/tmp/tshome on the device. benchmarks/gpu_x4_session.md lists a whole session's calls.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  split)
    name=${2:?name}
    file=$(python3 -c "from tokenselect.models import registry as r; print(r.cached_path('$name'))")
    [ -f "$file" ] || { echo "not cached: run tokenselect fetch $name" >&2; exit 2; }
    rm -rf ".carry/parts/$name" && mkdir -p ".carry/parts/$name"
    split -b "${3:-18000000}" -d -a 2 "$file" ".carry/parts/$name/part"
    ls -l ".carry/parts/$name"
    ;;
  receive)
    name=${2:?name}
    mkdir -p "/tmp/model_parts/$name"
    for p in ".carry/parts/$name"/part*; do cp "$p" "/tmp/model_parts/$name/"; done
    ls -l "/tmp/model_parts/$name"
    ;;
  assemble)
    name=${2:?name}
    python3 - "$name" <<'PY'
import sys
from pathlib import Path
from tokenselect.models import registry
parts = sorted(Path("/tmp/model_parts", sys.argv[1]).glob("part*"))
print(registry.install(sys.argv[1], (open(p, "rb") for p in parts), progress=False))
PY
    ;;
  wheels)
    rm -rf .carry/whl && python3 -m pip download -q --no-deps -d .carry/whl gguf wonderwords && ls -l .carry/whl ;;
  install-wheels)
    python3 -m pip install -q --no-deps --target /tmp/site .carry/whl/*.whl && ls /tmp/site ;;
  *)
    sed -n '2,23p' "$0"; exit 2 ;;
esac

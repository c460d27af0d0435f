#!/usr/bin/env bash
# Carry registry models to the GPU machine, whose calls take at most 64 MiB of working tree each: each GGUF goes in
# parts, one part a call, the calls back to back while the machine is warm (its /tmp lasts while it stays warm).
#
#   here:    benchmarks/model_parts.sh split NAME [BYTES]  -> .carry/parts/NAME/part00 .. partNN
#   device:  benchmarks/model_parts.sh receive NAME        -> the carried part(s) of NAME into /tmp/model_parts/NAME/
#   device:  benchmarks/model_parts.sh assemble NAME       -> $TOKENSELECT_HOME/models/NAME/FILE, size and sha256 checked
#
# BYTES (default 24,600,000) plus the rest of the tree must stay under 64 MiB: with the tree as it is (~39 MB, of
# which 31 MB are the embedded model's safetensors) parts of 24.6 MB fit; moved out of the working tree for the
# carrying calls (benchmarks/embedded_model.sh away, then back), parts of 55,000,000 bytes fit beside ~4 MB more
# (wheels or prompts). SmolLM2 (98 MB) is then 2 parts, Qwen2.5-Coder-0.5B (491 MB) 9.
#
# Call sequence (each a `run` with carry [".carry/parts/NAME/partNN"], the next issued as soon as one returns):
#   1 .. N-1:  benchmarks/model_parts.sh receive NAME
#   N:         benchmarks/model_parts.sh receive NAME && benchmarks/model_parts.sh assemble NAME && <the work>
# with TOKENSELECT_HOME=/tmp/tshome on the device. benchmarks/gpu_x4_session.md lists a whole session's calls.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  split)
    name=${2:?name}
    file=$(python3 -c "from tokenselect.models import registry as r; print(r.cached_path('$name'))")
    [ -f "$file" ] || { echo "not cached: run tokenselect fetch $name" >&2; exit 2; }
    rm -rf ".carry/parts/$name" && mkdir -p ".carry/parts/$name"
    split -b "${3:-24600000}" -d -a 2 "$file" ".carry/parts/$name/part"
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
  *)
    sed -n '2,18p' "$0"; exit 2 ;;
esac

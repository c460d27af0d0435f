#!/usr/bin/env bash
# Carry a registry model to the GPU machine, whose calls take at most 64 MiB of working tree each: the GGUF goes
# in parts of 24.6 MB (four for SmolLM2) (the tracked tree is ~38 MB), one part a call, calls back to back while the machine is warm.
#
#   here:    benchmarks/model_parts.sh split NAME        -> .carry/model/part00 .. partNN; prints the call sequence
#   device:  benchmarks/model_parts.sh receive           -> moves the carried part(s) into /tmp/model_parts/
#   device:  benchmarks/model_parts.sh assemble NAME     -> $TOKENSELECT_HOME/models/NAME/FILE, size and sha256 checked
#
# Call sequence (each a `run` with carry [".carry/model/partNN"], the next one issued as soon as one returns):
#   1 .. N-1:  benchmarks/model_parts.sh receive
#   N:         benchmarks/model_parts.sh receive && benchmarks/model_parts.sh assemble NAME && <the work>
# with TOKENSELECT_HOME=/tmp/tshome on the device (its /tmp lasts while the machine stays warm).
set -euo pipefail
cd "$(dirname "$0")/.."
part_bytes=24600000
case "${1:-}" in
  split)
    name=${2:?name}
    file=$(python3 -c "from tokenselect.models import registry as r; print(r.cached_path('$name'))")
    [ -f "$file" ] || { echo "not cached: run tokenselect fetch $name" >&2; exit 2; }
    rm -rf .carry/model && mkdir -p .carry/model
    split -b "$part_bytes" -d -a 2 "$file" .carry/model/part
    ls .carry/model
    ;;
  receive)
    mkdir -p /tmp/model_parts
    for p in .carry/model/part*; do cp "$p" /tmp/model_parts/; done
    ls -l /tmp/model_parts
    ;;
  assemble)
    name=${2:?name}
    python3 - "$name" <<'EOF'
import sys
from pathlib import Path
from tokenselect.models import registry
parts = sorted(Path("/tmp/model_parts").glob("part*"))
print(registry.install(sys.argv[1], (open(p, "rb") for p in parts), progress=False))
EOF
    ;;
  *)
    sed -n '2,15p' "$0"; exit 2 ;;
esac

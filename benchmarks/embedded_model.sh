#!/usr/bin/env bash
# Move the embedded model's weights (31 MB of the tracked tree) out of the working tree while model parts are
# carried to the GPU machine, and back (issue #27: the device takes 64 MiB of tree a call). Nothing runs that needs
# them in between; `back` also restores them from git if the saved copy is gone.
#
#   benchmarks/embedded_model.sh away | back
set -euo pipefail
cd "$(dirname "$0")/.."
weights=tokenselect/data/default_model
keep=/tmp/tokenselect_embedded_weights
case "${1:-}" in
  away) mkdir -p "$keep" && mv "$weights"/model-*.safetensors "$keep"/ && echo "moved to $keep" ;;
  back)
    if compgen -G "$keep/model-*.safetensors" > /dev/null; then mv "$keep"/model-*.safetensors "$weights"/; fi
    git checkout -- "$weights" && git status --short "$weights" && echo "restored" ;;
  *) sed -n '2,6p' "$0"; exit 2 ;;
esac

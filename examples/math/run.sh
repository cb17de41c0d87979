#!/usr/bin/env bash
# The math recipe on bundled GSM8K: build the tiny model (once), then RL. Extra arguments are config
# overrides, e.g. `bash examples/math/run.sh steps=5`.
set -euo pipefail
# -h, --help: this usage and the comment above, and nothing run
for arg in "$@"; do case "$arg" in -h | --help)
    echo "usage: bash examples/math/run.sh [key=value ...]"
    awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"
    exit 0 ;;
esac; done
cd "$(dirname "$0")/../.."
[ -d runs/math/tiny ] || areal-agents tiny-model runs/math/tiny
areal-agents train examples/math/rl.yaml --overwrite "$@"

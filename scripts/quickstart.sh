#!/usr/bin/env bash
# Set up, then run the arithmetic recipe end to end: tiny model -> SFT warm start -> RL (decoupled PPO).
set -euo pipefail
# -h, --help: this usage and the comment above, and nothing run
for arg in "$@"; do case "$arg" in -h | --help)
    echo "usage: bash scripts/quickstart.sh [key=value ...]   (overrides for the RL step)"
    awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"
    exit 0 ;;
esac; done
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PATH="$PWD/.venv/bin:$PATH" bash examples/arithmetic/run.sh "$@"

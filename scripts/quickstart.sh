#!/usr/bin/env bash
# Set up, then run the arithmetic recipe end to end: tiny model -> SFT warm start -> RL (decoupled PPO).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PATH="$PWD/.venv/bin:$PATH" bash examples/arithmetic/run.sh "$@"

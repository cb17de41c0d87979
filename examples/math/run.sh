#!/usr/bin/env bash
# The math recipe on bundled GSM8K: build the tiny model (once), then RL. Extra arguments are config
# overrides, e.g. `bash examples/math/run.sh steps=5`.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -d runs/math/tiny ] || areal-agents tiny-model runs/math/tiny
areal-agents train examples/math/rl.yaml "$@"

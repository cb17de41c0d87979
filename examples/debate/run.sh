#!/usr/bin/env bash
# The debate recipe: tiny model -> SFT on single problems and debate-shaped turns -> shared-policy debate RL.
# Extra arguments are config overrides for the RL step, e.g. `bash examples/debate/run.sh steps=50`.
set -euo pipefail
# -h, --help: this usage and the comment above, and nothing run
for arg in "$@"; do case "$arg" in -h | --help)
    echo "usage: bash examples/debate/run.sh [key=value ...]"
    awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"
    exit 0 ;;
esac; done
cd "$(dirname "$0")/../.."
RUN=runs/debate

areal-agents tiny-model --overwrite "$RUN/tiny"   # the same model each time (seeded)
python examples/debate/make_sft_data.py "$RUN/sft_data.jsonl" --n 20000
areal-agents sft examples/debate/sft.yaml --overwrite
areal-agents train examples/debate/rl.yaml --overwrite "$@"

#!/usr/bin/env bash
# The count recipe: build the tiny model, warm-start it with SFT, then train it with RL. Answers are
# long-tailed in length (1 to 32 numbers), so this is the recipe to try asynchronous RL on:
#   bash examples/count/run.sh rollout.max_staleness=1 engine.own_process=true ppo.trainer=process
# Extra arguments are config overrides for the RL step.
set -euo pipefail
# -h, --help: this usage and the comment above, and nothing run
for arg in "$@"; do case "$arg" in -h | --help)
    echo "usage: bash examples/count/run.sh [key=value ...]"
    awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"
    exit 0 ;;
esac; done
cd "$(dirname "$0")/../.."
RUN=runs/count

areal-agents tiny-model --overwrite "$RUN/tiny"   # the same model each time (seeded)
python examples/count/make_sft_data.py "$RUN/sft_data.jsonl" --n 20000
areal-agents sft examples/count/sft.yaml --overwrite
areal-agents train examples/count/rl.yaml --overwrite "$@"

#!/usr/bin/env bash
# The count recipe: build the tiny model, warm-start it with SFT, then train it with RL. Answers are
# long-tailed in length (1 to 32 numbers), so this is the recipe to try asynchronous RL on:
#   bash examples/count/run.sh rollout.max_staleness=1 engine.own_process=true ppo.trainer=process
# Extra arguments are config overrides for the RL step.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUN=runs/count

areal-agents tiny-model --overwrite "$RUN/tiny"   # the same model each time (seeded)
python examples/count/make_sft_data.py "$RUN/sft_data.jsonl" --n 20000
areal-agents sft examples/count/sft.yaml
areal-agents train examples/count/rl.yaml "$@"

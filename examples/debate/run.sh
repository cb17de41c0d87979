#!/usr/bin/env bash
# The debate recipe: tiny model -> SFT on single problems and debate-shaped turns -> shared-policy debate RL.
# Extra arguments are config overrides for the RL step, e.g. `bash examples/debate/run.sh steps=50`.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUN=runs/debate

areal-agents tiny-model --overwrite "$RUN/tiny"   # the same model each time (seeded)
python examples/debate/make_sft_data.py "$RUN/sft_data.jsonl" --n 20000
areal-agents sft examples/debate/sft.yaml
areal-agents train examples/debate/rl.yaml "$@"

#!/usr/bin/env bash
# The single-GPU recipe: a 0.44B Qwen3-shaped model (or yours), SFT warm start, then colocated RL on one GPU.
#   bash examples/gpu/run.sh [key=value ...]                       # overrides for the RL step, e.g. steps=50
#   MODEL=/models/Qwen3-0.6B bash examples/gpu/run.sh              # start from your own local checkpoint
set -euo pipefail
# -h, --help: this usage and the comment above, and nothing run
for arg in "$@"; do case "$arg" in -h | --help)
    echo "usage: [MODEL=DIR] bash examples/gpu/run.sh [key=value ...]"
    awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"
    exit 0 ;;
esac; done
cd "$(dirname "$0")/../.."
RUN=runs/gpu

if [ -n "${MODEL:-}" ]; then
    START="$MODEL"
else
    areal-agents tiny-model --preset qwen3-0.4b --overwrite "$RUN/qwen3"   # the same model each time (seeded)
    START="$RUN/qwen3"
fi
python examples/arithmetic/make_sft_data.py "$RUN/sft_data.jsonl" --n 20000
areal-agents sft examples/gpu/sft.yaml --overwrite model.path="$START"
areal-agents train examples/gpu/rl.yaml --overwrite "$@"

python - <<'PY'
import json
sft = json.load(open("runs/gpu/sft/summary.json"))
rl = json.load(open("runs/gpu/rl/summary.json"))
print(f"\nheld-out greedy accuracy ({rl['eval_problems']} problems): "
      f"after SFT {sft['accuracy_after']:.1%} -> after RL {rl['accuracy_after']:.1%} "
      f"({100 * (rl['accuracy_after'] - sft['accuracy_after']):+.1f} points)")
PY

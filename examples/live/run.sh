#!/usr/bin/env bash
# RL from live traffic: build the tiny model, warm-start it with SFT on addition, then train it from the
# sessions a stand-in app sends through the gateway (rewards posted 0.5-3 s after each session ends).
# Extra arguments are config overrides for the RL run, e.g. `bash examples/live/run.sh steps=40`.
set -euo pipefail
# -h, --help: this usage and the comment above, and nothing run
for arg in "$@"; do case "$arg" in -h | --help)
    echo "usage: bash examples/live/run.sh [key=value ...]"
    awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"
    exit 0 ;;
esac; done
cd "$(dirname "$0")/../.."
RUN=runs/live

areal-agents tiny-model --overwrite "$RUN/tiny"   # the same model each time (seeded)
python examples/arithmetic/make_sft_data.py "$RUN/sft_data.jsonl" --n 20000
areal-agents sft examples/arithmetic/sft.yaml --overwrite run_dir="$RUN/sft" data="$RUN/sft_data.jsonl" model.path="$RUN/tiny"
rm -f "$RUN/rl/gateway.json"
areal-agents train examples/live/rl.yaml --overwrite "$@" &
TRAIN=$!
python examples/live/app.py --run-dir "$RUN/rl" --users 32 --reward-delay 0.5,3   # until the run stops serving
wait "$TRAIN"
python - <<'PY'
import json
rl = json.load(open("runs/live/rl/summary.json"))
print(f"\nheld-out greedy accuracy ({rl['eval_problems']} problems): {rl['accuracy_before']:.1%} -> {rl['accuracy_after']:.1%}")
print("by RL step:  " + "  ".join(f"{step:>5}" for step, _ in rl["accuracy_curve"]))
print("accuracy:    " + "  ".join(f"{acc:5.1%}" for _, acc in rl["accuracy_curve"]))
PY

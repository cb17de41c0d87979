#!/usr/bin/env bash
# The arithmetic recipe: build the tiny model, warm-start it with SFT, then train it with RL.
# Extra arguments are config overrides for the RL step, e.g. `bash examples/arithmetic/run.sh steps=50`.
set -euo pipefail
# -h, --help: this usage and the comment above, and nothing run
for arg in "$@"; do case "$arg" in -h | --help)
    echo "usage: bash examples/arithmetic/run.sh [key=value ...]"
    awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"
    exit 0 ;;
esac; done
cd "$(dirname "$0")/../.."
RUN=runs/arith

areal-agents tiny-model --overwrite "$RUN/tiny"   # the same model each time (seeded)
python examples/arithmetic/make_sft_data.py "$RUN/sft_data.jsonl" --n 20000
areal-agents sft examples/arithmetic/sft.yaml --overwrite
areal-agents train examples/arithmetic/rl.yaml --overwrite "$@"

python - <<'PY'
import json
sft = json.load(open("runs/arith/sft/summary.json"))
rl = json.load(open("runs/arith/rl/summary.json"))
print(f"\nheld-out greedy accuracy ({rl['eval_problems']} problems): "
      f"after SFT {sft['accuracy_after']:.1%} -> after RL {rl['accuracy_after']:.1%} "
      f"({100 * (rl['accuracy_after'] - sft['accuracy_after']):+.1f} points)")
print("by RL step:  " + "  ".join(f"{step:>5}" for step, _ in rl["accuracy_curve"]))
print("accuracy:    " + "  ".join(f"{acc:5.1%}" for _, acc in rl["accuracy_curve"]))
print("curves: areal-agents plot runs/arith/rl  (PNGs in runs/arith/rl/plots/)")
PY

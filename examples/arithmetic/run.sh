#!/usr/bin/env bash
# The arithmetic recipe: build the tiny model, warm-start it with SFT, then train it with RL.
# Extra arguments are config overrides for the RL step, e.g. `bash examples/arithmetic/run.sh steps=50`.
set -euo pipefail
cd "$(dirname "$0")/../.."
RUN=runs/arith

areal-agents tiny-model --overwrite "$RUN/tiny"   # the same model each time (seeded)
python examples/arithmetic/make_sft_data.py "$RUN/sft_data.jsonl" --n 20000
areal-agents sft examples/arithmetic/sft.yaml
areal-agents train examples/arithmetic/rl.yaml "$@"

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

#!/usr/bin/env bash
# tinker-cookbook's RL recipe, unchanged, against a local serve-tinker: build the tiny model, teach it addition in
# the cookbook's form (areal-agents sft: the part a pretrained instruct model plays on Tinker), serve it with
# serve-tinker, run `python -m tinker_cookbook.recipes.math_rl.train env=arithmetic` against it, then print the
# accuracy before and after (evaluate.py) and the recipe's own curve. Extra arguments go to the recipe (max_steps=60).
set -euo pipefail
# -h, --help: this usage and the comment above, and nothing run
for arg in "$@"; do case "$arg" in -h | --help)
    echo "usage: bash examples/tinker/run.sh [recipe_key=value ...]"
    awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"
    exit 0 ;;
esac; done
cd "$(dirname "$0")/../.."
RUN=runs/tinker

areal-agents tiny-model --overwrite "$RUN/tiny"   # the same model each time (seeded)
python examples/tinker/make_sft_data.py "$RUN/sft_data.jsonl" --n 60000
areal-agents sft examples/tinker/sft.yaml --overwrite
BASE=$(realpath "$RUN/sft/model")   # the cookbook loads the tokenizer by model_name: the directory is the name
PORT=$(python -c 'from areal_agents.net import free_port; print(free_port())')
areal-agents serve-tinker --base-model "$BASE=$BASE" --checkpoint-root "$RUN/checkpoints" --port "$PORT" &
SERVER=$!
trap 'kill $SERVER 2>/dev/null' EXIT
until curl -sf "http://127.0.0.1:$PORT/api/v1/healthz" >/dev/null; do
  kill -0 $SERVER 2>/dev/null || { echo "serve-tinker stopped" >&2; exit 1; }
  sleep 0.2
done

export TINKER_API_KEY=tml-local TINKER_TELEMETRY=0   # any tml- key; no telemetry leaves the machine
python -m tinker_cookbook.recipes.math_rl.train env=arithmetic model_name="$BASE" renderer_name=qwen3 \
  loss_fn=importance_sampling group_size=16 groups_per_batch=16 max_tokens=8 learning_rate=1e-3 max_steps=40 \
  eval_every=0 save_every=0 log_path="$RUN/rl" behavior_if_log_dir_exists=delete base_url="http://127.0.0.1:$PORT" \
  "$@" > "$RUN/rl.log" 2>&1 || { tail -20 "$RUN/rl.log"; exit 1; }
python examples/tinker/evaluate.py --base-url "http://127.0.0.1:$PORT" --model "$BASE" --run "$RUN/rl"
python - <<'PY'
import json

rows = [json.loads(line) for line in open("runs/tinker/rl/metrics.jsonl") if "env/all/correct" in line]
correct = [r["env/all/correct"] for r in rows]
k = max(1, len(correct) // 5)
blocks = [correct[i : i + k] for i in range(0, len(correct), k)]
print(f"math_rl's own env/all/correct ({len(rows)} steps of {rows[0]['env/all/total_episodes']:.0f} samples at temperature 1):")
print("steps:    " + " ".join(f"{f'{i * k}-{i * k + len(b) - 1}':>7}" for i, b in enumerate(blocks)))
print("correct:  " + " ".join(f"{sum(b) / len(b):7.1%}" for b in blocks))
PY

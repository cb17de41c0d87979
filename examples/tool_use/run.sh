#!/usr/bin/env bash
# The tool-use recipe for one model family: a tiny model with that family's tokenizer and chat template, an SFT
# warm start on tool-use conversations in its format, then RL with a ToolAgent that answers its calls.
#   bash examples/tool_use/run.sh FAMILY [key=value ...]   (qwen3 qwq deepseek-r1 mistral gpt-oss granite)
# Extra arguments are config overrides for the RL step, e.g. `bash examples/tool_use/run.sh qwen3 steps=10`.
set -euo pipefail
# -h, --help: this usage and the comment above, and nothing run
for arg in "$@"; do case "$arg" in -h | --help)
    echo "usage: bash examples/tool_use/run.sh FAMILY [key=value ...]"
    awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"
    exit 0 ;;
esac; done
cd "$(dirname "$0")/../.."
FAMILY="${1:?usage: run.sh FAMILY [key=value ...] with FAMILY one of qwen3 qwq deepseek-r1 mistral gpt-oss granite}"
shift
RUN="runs/tool_use/$FAMILY"

areal-agents tiny-model --overwrite --family "$FAMILY" "$RUN/tiny"   # the same model each time (seeded)
python examples/tool_use/make_sft_data.py "$RUN/sft_data.jsonl" --family "$FAMILY"
areal-agents sft examples/tool_use/sft.yaml --overwrite model.path="$RUN/tiny" data="$RUN/sft_data.jsonl" run_dir="$RUN/sft"
areal-agents train examples/tool_use/rl.yaml --overwrite model.path="$RUN/sft/model" run_dir="$RUN/rl" "$@"

echo
echo "tool calls, parse failures and segments per episode: tensorboard --logdir $RUN/rl/tensorboard"
echo "every sampled episode, token by token: $RUN/rl/trajectories/step_N.jsonl"

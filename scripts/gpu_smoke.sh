#!/usr/bin/env bash
# GPU smoke test of the SGLang path (see scripts/gpu_smoke.py): one prepared command for a GPU machine.
#   bash scripts/gpu_smoke.sh /models/Qwen2.5-0.5B-Instruct [--nccl]
# Installs sglang into the project venv if it is missing (needs a CUDA machine and network to PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -lt 1 ]; then
    echo "usage: bash scripts/gpu_smoke.sh MODEL_DIR [--nccl]" >&2
    exit 2
fi
[ -x .venv/bin/python ] || bash scripts/setup.sh
.venv/bin/python -c "import sglang" 2>/dev/null || .venv/bin/pip install -q "sglang[all]"
exec .venv/bin/python scripts/gpu_smoke.py "$@"

#!/usr/bin/env bash
# The device check's packages rehearsed on the CPU (issue 50 item 7): a fresh venv holding only what the GPU
# machine has (KINDS.md's packages that the check imports, at the machine's versions where they are known) and
# the wheels scripts/gpu_check.sh carries, installed as there (--no-deps, --target, ahead on PYTHONPATH); then
# gpu_check.sh --cpu-rehearsal in it. A package the check needs and neither provides fails its import step.
#
#   bash scripts/gpu_check_rehearsal.sh                          # venv and wheels under /tmp/gpu_check_rehearsal
#   bash scripts/gpu_check_rehearsal.sh --parts abde --cap-scale 0.5   # extra arguments go to bench/gpu_check.py
#
# What differs from the machine, and why: CPU torch from a local wheel (pip's find-links, see below)
# instead of 2.11+cu130, and the Python that wheel is for (REHEARSAL_PY, python3: 3.11 here; the machine's is
# 3.12), so the carried wheels are fetched again for that Python: the same names and versions, the same files
# for the pure-Python ones (all but pydantic-core and jiter); numpy is the newest for that Python (2.5 needs
# 3.12).
set -euo pipefail
# -h, --help: this usage and the comment above, and nothing run
for arg in "$@"; do case "$arg" in -h | --help)
    echo "usage: bash scripts/gpu_check_rehearsal.sh [bench/gpu_check.py arguments ...]"
    awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"
    exit 0 ;;
esac; done
cd "$(dirname "$0")/.."
BASE=${REHEARSAL_DIR:-/tmp/gpu_check_rehearsal}
PYBASE=${REHEARSAL_PY:-python3}
PYVER=$("$PYBASE" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
# The machine's packages the check imports (bench/gpu_check_imports.py: "device"), pinned where KINDS.md
# gives a version; numpy 2.5 needs 3.12. torch: REHEARSAL_TORCH, else the newest CPU build for this Python in
# pip's find-links ($PIP_FIND_LINKS), else PyPI's (on Linux a CUDA build, GBs, which runs on the CPU too).
NUMPY=numpy==2.5.2
[ "$PYVER" = 3.12 ] || NUMPY=numpy
TORCH=${REHEARSAL_TORCH:-}
if [ -z "$TORCH" ]; then
    read -ra links <<<"${PIP_FIND_LINKS:-}"
    TORCH=$(find "${links[@]}" -maxdepth 1 -name "torch-*+cpu-cp${PYVER/./}-*.whl" 2>/dev/null | sort -V | tail -1)
    TORCH=${TORCH:-torch}
fi
DEVICE_PKGS=(
    "$TORCH" transformers==5.17.0 tokenizers==0.23.2 huggingface-hub==1.33.0 safetensors==0.8.0 "$NUMPY"
    accelerate==1.15.0 absl-py aiohttp attrs click filelock fsspec h11 idna jinja2 mpmath packaging pillow
    protobuf psutil pyyaml regex sympy tensorboard tqdm peft
)

rm -rf "$BASE" && mkdir -p "$BASE"
echo "== the carried wheels, for Python $PYVER (the machine's: bash scripts/gpu_check.sh --download-wheels)"
GPU_CHECK_WHL="$BASE/whl" GPU_CHECK_WHEEL_PY="$PYVER" bash scripts/gpu_check.sh --download-wheels
echo "== a fresh venv: $("$PYBASE" -V) at $BASE/venv, the machine's packages only"
"$PYBASE" -m venv "$BASE/venv"
"$BASE/venv/bin/python" -m pip install -q "${DEVICE_PKGS[@]}"
# pip pulls their requirements too (transformers 5.17's typer pulls pydantic): each must be on the machine's
# list, or carried, and then it goes, so that only the carried copy serves, as there.
"$BASE/venv/bin/python" - <<'EOF'
import importlib.metadata as md, subprocess, sys
sys.path.insert(0, "bench")
from gpu_check_imports import DEVICE, carried, normalise
extra = sorted({normalise(d.metadata["Name"]) for d in md.distributions()} - DEVICE)
print("venv packages not on the machine's list:", " ".join(extra) or "none")
if set(extra) - set(carried()):
    sys.exit(f"neither on the machine nor carried: {' '.join(sorted(set(extra) - set(carried())))}")
if extra:
    print("carried, so uninstalled here:", " ".join(extra))
    subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", *extra], check=True)
EOF
"$BASE/venv/bin/python" -m pip freeze >"$BASE/venv_freeze.txt"
echo "== gpu_check.sh --cpu-rehearsal in it, the wheels installed as on the machine"
GPU_CHECK_PYTHON="$BASE/venv/bin/python" GPU_CHECK_WHEELS=1 GPU_CHECK_WHL="$BASE/whl" GPU_CHECK_SITE="$BASE/site" \
    OUT="${OUT:-$BASE/out}" bash scripts/gpu_check.sh --cpu-rehearsal "$@"

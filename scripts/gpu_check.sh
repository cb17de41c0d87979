#!/usr/bin/env bash
# The device check of issue 30 (bench/gpu_check.py): the bf16 peak and an FSDP2 PPO step's MFU, HFEngine
# on the GPU, 30 colocated RL steps, in_process vs disk weight sync, the train/inference mismatch. PASS/FAIL
# lines; every result appended to $OUT/gpu_check.json as it is known. Sized for one H200 lent for 15 minutes
# (start-up included): at most 5 minutes here, each part capped (docs/gpu.md, "The device check").
#
#   bash scripts/gpu_check.sh --download-wheels   # here, with PyPI: the packages the GPU machine lacks -> .whl/
#   bash scripts/gpu_check.sh                     # there: installs .whl/ (carried), runs from this tree
#   bash scripts/gpu_check.sh --cpu-rehearsal     # here: a small model, the same code paths, <= 10 minutes
#
# The GPU machine has torch 2.11 and transformers 5.17 but no network: what it lacks travels as wheels
# (the device tool's `carry: [".whl"]`), installed with --no-deps into /tmp/site, ahead of its own packages.
# bench/gpu_check_imports.py lists what the check imports against the machine's packages and WHEELS, and
# scripts/gpu_check_rehearsal.sh rehearses it on the CPU in a venv of those packages and these wheels only
# (GPU_CHECK_PYTHON: the Python to run; GPU_CHECK_WHEELS=1: install the wheels in --cpu-rehearsal too;
# GPU_CHECK_WHL: their folder, .whl by default; GPU_CHECK_WHEEL_PY: the Python they are for, 3.12 by default).
# Extra arguments go to bench/gpu_check.py (--parts ad, --cap-scale 0.5, --out DIR).
set -uo pipefail
# -h, --help: this usage and the comment above, and nothing run
for arg in "$@"; do case "$arg" in -h | --help)
    echo "usage: bash scripts/gpu_check.sh [--download-wheels | --cpu-rehearsal] [bench/gpu_check.py's arguments]"
    awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"
    exit 0 ;;
esac; done
cd "$(dirname "$0")/.." || exit 1

# One version each (two of one package stop the install). transformers >= pyproject's floor; the machine's
# tokenizers 0.23.2, huggingface-hub 1.33 and safetensors 0.8.0 satisfy its requirements, so they stay.
# peft is on the machine at a version nobody has read: areal_agents.trainers.lora imports it at start and it
# reaches into transformers' internals, so the version tested with the carried transformers travels too.
WHEELS=(
    transformers==5.24.0 peft==0.21.2
    gymnasium==1.4.0 farama-notifications==0.0.6
    fastapi==0.165.0 starlette==1.10.0 opentelemetry-api==1.45.2 annotated-doc==0.0.7
    pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0
    typing-extensions==4.16.0 uvicorn==0.55.0
    math-verify==0.9.0 latex2sympy2_extended==1.11.0 antlr4-python3-runtime==4.13.2
    openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 anyio==4.16.0 sniffio==1.3.1 jiter==0.19.0
)
NAMES=(torch transformers tokenizers huggingface-hub safetensors numpy typer httpx "${WHEELS[@]%%==*}")

# Where the wheels go and for which Python: .whl/ and 3.12 (the machine's) unless the rehearsal says otherwise.
WHL=${GPU_CHECK_WHL:-.whl}
if [ "${1:-}" = "--download-wheels" ]; then
    PY=$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )
    rm -rf "$WHL" && mkdir -p "$WHL"
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "${GPU_CHECK_WHEEL_PY:-3.12}" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHL" "${WHEELS[@]}" || exit 1
    du -k "$WHL"/*.whl | sort -rn  # KiB each
    whls=("$WHL"/*.whl)
    echo "${#whls[@]} wheels, $(du -sh "$WHL" | cut -f1) in $WHL/ (git-ignored; the device tool carries 64 MiB" \
        "in all): carry [\".whl\"] to the device"
    exit 0
fi

REHEARSAL=0
for a in "$@"; do [ "$a" = "--cpu-rehearsal" ] && REHEARSAL=1; done
export OUT="${OUT:-runs/gpu_check}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
if [ $REHEARSAL = 1 ]; then
    PY=$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )
    LIMIT=600
    WHEELS_IN=${GPU_CHECK_WHEELS:-0}
else
    PY=python3
    LIMIT=300
    WHEELS_IN=1
fi
PY=${GPU_CHECK_PYTHON:-$PY}

echo "== what is there (pip show, before the carried wheels)"
"$PY" -m pip show "${NAMES[@]}" 2>&1 | grep -E "^(Name|Version):|not found" | paste -sd' ' \
    | sed 's/ Name:/\nName:/g' | tee "$OUT/pip_show.txt"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

if [ "$WHEELS_IN" = 1 ]; then
    if ! ls "$WHL"/*.whl >/dev/null 2>&1; then
        echo "FAIL meta. no .whl/ here: run 'bash scripts/gpu_check.sh --download-wheels' first, then carry .whl"
        exit 1
    fi
    start=$SECONDS
    SITE=${GPU_CHECK_SITE:-/tmp/site}
    rm -rf "$SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$WHL"/*.whl \
        || { echo "FAIL meta. pip install of the carried wheels"; exit 1; }
    whls=("$WHL"/*.whl)
    echo "INFO meta. ${#whls[@]} wheels installed into $SITE in $((SECONDS - start))s"
    export PYTHONPATH="$SITE:$PWD"
else
    export PYTHONPATH="$PWD"
fi

# Every module the check imports, in seconds: a package the machine lacks is named here, not minutes later.
if ! PYTHONPATH="$PYTHONPATH:$PWD/bench" timeout 120 "$PY" bench/gpu_check_imports.py 2>&1 | tee "$OUT/imports.txt"; then
    echo "FAIL meta. the check imports a package neither the machine nor .whl/ has (above: missing, or the ImportError)"
    exit 1
fi

timeout --signal=TERM --kill-after=10 "$LIMIT" "$PY" bench/gpu_check.py "$@" 2>&1 | tee "$OUT/gpu_check.log"
rc=${PIPESTATUS[0]}
[ "$rc" = 124 ] && echo "FAIL meta. the check ran past its ${LIMIT}s limit (what it measured is in $OUT/gpu_check.json)"
exit "$rc"

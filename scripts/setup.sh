#!/usr/bin/env bash
# Set up a fresh machine: .venv with torch, areal-agents (+ dev, e2b, ray extras) and bubblewrap, the local
# sandbox's isolation layer. Idempotent: a second run only checks.
#
# torch: a torch already in .venv (>= 2.6) is kept, so a GPU user installs the CUDA build they want first.
# Otherwise, on a machine without an NVIDIA GPU, the CPU build from PyTorch's own index (PyPI's default
# Linux build bundles CUDA: several GB); if that index is unreachable, the default index (pip's own
# configuration: on the project's dev machines, a local CPU wheel). On an NVIDIA machine, the default
# index's build (CUDA). Sourcing this file defines the functions without running anything (tests use it).
set -euo pipefail

VENV=${VENV:-.venv}
TORCH_VERSION=2.13.0  # the release the code is tested with; pyproject admits any torch >= 2.6
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
NVIDIA_PROC=${NVIDIA_PROC:-/proc/driver/nvidia}

pip_install() {
  # Some machines' pip config names local wheel folders that may be absent; drop only those warnings.
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "$@" \
    2> >(grep -v "is neither a file nor a directory" >&2)
}

has_nvidia_gpu() {
  command -v nvidia-smi >/dev/null 2>&1 || [ -e "$NVIDIA_PROC" ]
}

# Prints how torch gets into the venv: keep | cpu-index | default.
torch_plan() {
  if "$VENV/bin/python" -c 'import sys, torch
v = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2])
sys.exit(v < (2, 6))' >/dev/null 2>&1; then
    echo keep
  elif has_nvidia_gpu; then
    echo default
  else
    echo cpu-index
  fi
}

install_torch() {
  local plan
  plan=$(torch_plan)
  case "$plan" in
    keep) ;;
    cpu-index)
      # Fail fast where the index is unreachable (a closed network, a PyPI-only mirror).
      if ! pip_install --index-url "$TORCH_CPU_INDEX" --timeout 10 --retries 0 "torch==$TORCH_VERSION"; then
        echo "setup: PyTorch's CPU index ($TORCH_CPU_INDEX) failed; installing torch==$TORCH_VERSION" \
          "from the default index" >&2
        pip_install "torch==$TORCH_VERSION"
      fi
      ;;
    default)
      echo "setup: NVIDIA GPU found: installing torch==$TORCH_VERSION from the default index (its CUDA build)." \
        "For another CUDA version, install torch into $VENV first (pip install torch --index-url" \
        "https://download.pytorch.org/whl/cuXYZ); setup keeps it." >&2
      pip_install "torch==$TORCH_VERSION"
      ;;
  esac
}

main() {
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  local python=${PYTHON:-python3}
  if [ ! -x "$VENV/bin/python" ]; then
    "$python" -m venv "$VENV"
  fi
  install_torch
  pip_install -e ".[dev,e2b,ray]"   # e2b: its SDK's result types are tested here (the cloud is not); ray: a local cluster

  if ! command -v bwrap >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null) \
        || echo "setup: warning: could not install bubblewrap; the local code sandbox will be unavailable" >&2
    else
      echo "setup: warning: bubblewrap (bwrap) is missing; install it: sudo apt-get install -y bubblewrap" >&2
    fi
  fi
  echo "setup: ready ($("$VENV/bin/python" -c 'import areal_agents, torch, transformers; print(f"areal-agents {areal_agents.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")'))"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi

#!/usr/bin/env bash
# Set up a fresh machine: .venv with areal-agents (+ dev extra) and bubblewrap, the local sandbox's
# isolation layer. Idempotent: a second run only checks.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
pip_install() {
  # This machine's pip config names local wheel folders that may be absent; drop only those warnings.
  .venv/bin/pip install --quiet --disable-pip-version-check "$@" \
    2> >(grep -v "is neither a file nor a directory" >&2)
}
# torch first and pinned: pip then takes the local CPU wheel and never a multi-GB CUDA build.
pip_install torch==2.13.0
pip_install -e ".[dev,e2b,ray]"   # e2b: its SDK's result types are tested here (the cloud is not); ray: a local cluster

if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null) \
      || echo "setup: warning: could not install bubblewrap; the local code sandbox will be unavailable" >&2
  else
    echo "setup: warning: bubblewrap (bwrap) is missing; install it: sudo apt-get install -y bubblewrap" >&2
  fi
fi
echo "setup: ready ($(.venv/bin/python -c 'import areal_agents, torch, transformers; print(f"areal-agents {areal_agents.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")'))"

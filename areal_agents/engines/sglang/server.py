"""Start an SGLang server from an environment of its own (SGLang pins its torch and transformers, which clash
with ours: docs/sglang.md): its command line and a clear error when that interpreter lacks SGLang.

    python = sglang_python(cfg)     # engine.sglang_python, checked for the sglang module
    sglang_command(cfg, python, "/models/m", "bfloat16", 30000, base_gpu_id=0)
"""

from __future__ import annotations

from areal_agents.config import EngineConfig
from areal_agents.importing import python_with

SETUP_HINT = (
    "make an environment with SGLang and name its interpreter (docs/sglang.md): bash scripts/setup.sh --with-sglang "
    "builds .venv-sglang on an NVIDIA machine (engine.sglang_python=.venv-sglang/bin/python)"
)


def sglang_python(cfg: EngineConfig) -> str:
    """The interpreter that runs SGLang: ``engine.sglang_python``, else this one; an error if it lacks SGLang."""
    hint = (
        f"{SETUP_HINT}. Without a GPU, engine.backend=serve-model speaks the same API on CPU; "
        "engine.urls=[...] connects to running servers"
    )
    return python_with("sglang", cfg.sglang_python, "engine.sglang_python", hint)


def sglang_command(
    cfg: EngineConfig,
    python: str,
    model_path: str,
    dtype: str,
    port: int,
    *,
    base_gpu_id: int,
    tokenizer_path: str | None = None,
    weight_version: str | None = None,
) -> list[str]:
    """``python -m sglang.launch_server ...`` for one server: ``engine.tp`` as ``--tp-size``,
    ``engine.mem_fraction`` as ``--mem-fraction-static``, ``dtype`` (`engine_dtype`'s), the first of its
    GPUs among those it sees (``base_gpu_id``), a restart's tokenizer and weight_version, the LoRA flags
    (`lora_args`), ``engine.extra_args`` last (so they win); ``--enable-metrics``: a run's timeline polls /metrics."""
    command = [
        python, "-m", "sglang.launch_server", "--model-path", model_path, "--host", cfg.host, "--port", str(port),
        "--tp-size", str(cfg.tp), "--mem-fraction-static", str(cfg.mem_fraction), "--dtype", dtype,
        "--base-gpu-id", str(base_gpu_id), "--skip-server-warmup", "--enable-metrics",
    ]  # fmt: skip
    if tokenizer_path:
        command += ["--tokenizer-path", tokenizer_path]
    if weight_version is not None:
        command += ["--weight-version", weight_version]
    return [*command, *lora_args(cfg), *cfg.extra_args]


def lora_args(cfg: EngineConfig) -> list[str]:
    """SGLang's flags for serving adapters when ``engine.max_lora_rank > 0``: ``--enable-lora``, the rank, every
    module SGLang can adapt (adapters are loaded at run time, so none can be inferred at start), and
    ``engine.max_loras`` + 1 adapters per batch (SGLang counts the base model's requests as one)."""
    if cfg.max_lora_rank <= 0:
        return []
    return [
        "--enable-lora", "--max-lora-rank", str(cfg.max_lora_rank), "--max-loras-per-batch", str(cfg.max_loras + 1),
        "--lora-target-modules", "all",
    ]  # fmt: skip

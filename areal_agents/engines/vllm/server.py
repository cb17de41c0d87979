"""Start a vLLM server from an environment of its own (vLLM's pins clash with ours): its command line,
the variables it needs, and a clear error when that interpreter lacks vLLM.

The server binds ``engine.host`` (127.0.0.1 by default). It runs with ``VLLM_SERVER_DEV_MODE=1``, which
exposes ``/collective_rpc`` (any method on the workers) to whoever reaches the port: keep it on a trusted
network. Its sockets and caches go to a scratch directory of its own (``TMPDIR``, and ``VLLM_CACHE_ROOT`` unless
the environment sets it, to keep compiled graphs across runs), which the launcher deletes when the server
stops.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from areal_agents.config import EngineConfig
from areal_agents.errors import ConfigError
from areal_agents.importing import python_with

SETUP_HINT = "bash scripts/setup.sh --with-vllm builds one in .venv-vllm (engine.vllm_python=.venv-vllm/bin/python)"
CPU_KV_CACHE_GIB = "1"  # vLLM's CPU backend: the KV cache's size unless VLLM_CPU_KVCACHE_SPACE says otherwise
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the --max-lora-rank values vLLM 0.32 accepts (MaxLoRARanks)


def vllm_python(cfg: EngineConfig) -> str:
    """The interpreter that runs vLLM: ``engine.vllm_python``, else this one; an error if it lacks vLLM."""
    return python_with("vllm", cfg.vllm_python, "engine.vllm_python", SETUP_HINT)


def lora_rank_flag(rank: int, ranks: tuple[int, ...] = LORA_RANKS) -> int:
    """The smallest rank the server accepts that holds adapters of ``rank`` (engine.max_lora_rank); an
    error naming the field when ``rank`` is above them all."""
    for accepted in ranks:
        if accepted >= rank:
            return accepted
    raise ConfigError(f"engine.max_lora_rank: the server serves LoRA ranks up to {ranks[-1]}, got {rank}")


def lora_args(cfg: EngineConfig) -> list[str]:
    """vLLM's flags for serving adapters when ``engine.max_lora_rank > 0``: ``--enable-lora``, the rank
    rounded up to one vLLM takes, ``engine.max_loras`` adapters in a batch (and as many kept loaded)."""
    if cfg.max_lora_rank <= 0:
        return []
    return [
        "--enable-lora", "--max-lora-rank", str(lora_rank_flag(cfg.max_lora_rank)),
        "--max-loras", str(cfg.max_loras),
    ]  # fmt: skip


def checkpoint_dtype(model_path: str) -> str:
    """The dtype a checkpoint's config.json names (``dtype`` or the older ``torch_dtype``); float32 if none."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    return str(dtype).removeprefix("torch.")


def vllm_command(
    cfg: EngineConfig,
    python: str,
    model_path: str,
    dtype: str,
    port: int,
    scratch: Path,
    *,
    tokenizer_path: str | None = None,
    placement: dict[str, str] | None = None,
) -> list[str]:
    """``env VARS python -m vllm.entrypoints.openai.api_server ...`` for one server (the variables ride on
    the command line so that a restart by the `Supervisor` gets them too; ``placement``: its
    ``CUDA_VISIBLE_DEVICES`` when ``engine.gpus`` names them). ``--gpu-memory-utilization`` goes to the CPU
    build too, which accepts it and sizes its KV cache by ``VLLM_CPU_KVCACHE_SPACE`` instead. With
    ``engine.max_lora_rank`` it serves LoRA adapters loaded at run time (`lora_args`)."""
    variables = {
        **(placement or {}),
        "VLLM_SERVER_DEV_MODE": "1",  # /pause, /resume, /collective_rpc, /update_weight_version
        "VLLM_NO_USAGE_STATS": "1",
        "HF_HUB_OFFLINE": "1",  # the model is a local directory; never reach for the Hub
        "TMPDIR": str(scratch),  # its IPC sockets and vllm_dist_* files
        "VLLM_CACHE_ROOT": os.environ.get("VLLM_CACHE_ROOT", str(scratch / "cache")),  # set: kept across runs
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", CPU_KV_CACHE_GIB),
    }
    if cfg.host in ("127.0.0.1", "localhost"):
        variables["VLLM_HOST_IP"] = "127.0.0.1"
    if cfg.max_lora_rank > 0:
        variables["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"  # /v1/load_lora_adapter, /v1/unload_lora_adapter
    command = [
        python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--host", cfg.host,
        "--port", str(port), "--dtype", dtype, "--tensor-parallel-size", str(cfg.tp),
        "--gpu-memory-utilization", str(cfg.mem_fraction), "--enable-scale-out",
        "--logprobs-mode", "processed_logprobs",
    ]  # fmt: skip
    if cfg.max_model_len:
        command += ["--max-model-len", str(cfg.max_model_len)]
    command += lora_args(cfg)
    if tokenizer_path:
        command += ["--tokenizer", tokenizer_path]
    return ["env", *(f"{k}={v}" for k, v in variables.items()), *command, *cfg.extra_args]

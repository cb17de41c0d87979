"""serve-model's checks of a LoRA adapter a client asks it to load (/load_lora_adapter), made before the
engine reads a weight: the name (never the served model's id, which it would then answer for), the count of
adapters held (``--max-loras``) and the rank in the adapter's ``adapter_config.json`` (``--max-lora-rank``,
per-module ``rank_pattern`` ranks too). Errors name the field, file and key, never a value read from the file.

    check_adapter_load("a1", "/runs/x/adapter", served={"/models/base"}, loaded=["a0"], max_rank=64, max_loras=8)
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path
from typing import Any

MAX_NAME_CHARS = 256
MAX_CONFIG_BYTES = 1 << 20  # an adapter_config.json is a few hundred bytes; read no more than this


class AdapterRefused(ValueError):
    """An adapter load refused before the engine saw it (400), the field named."""


def check_adapter_load(
    name: Any, path: Any, *, served: Collection[str], loaded: Collection[str], max_rank: int, max_loras: int
) -> None:
    """`AdapterRefused` unless adapter ``name`` may be loaded from directory ``path`` beside ``loaded``."""
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_CHARS or not name.isprintable():
        raise AdapterRefused(f"lora_name: expects a printable name of 1 to {MAX_NAME_CHARS} characters")
    if name in served:
        raise AdapterRefused(
            f"lora_name: {name!r} is the served model's id; an adapter under it would answer the requests that "
            "name the base model (/v1's model field): choose another name"
        )
    if name not in loaded and len(loaded) >= max_loras:
        raise AdapterRefused(
            f"lora_name: {len(loaded)} adapters are loaded, as many as this server holds (--max-loras "
            f"{max_loras}): unload one first (/unload_lora_adapter)"
        )
    if not isinstance(path, str) or not path:
        raise AdapterRefused("lora_path: expects the adapter's directory (PEFT's save_pretrained output)")
    config_file, weights = Path(path) / "adapter_config.json", Path(path) / "adapter_model.safetensors"
    for file in (config_file, weights):
        if not file.is_file():
            raise AdapterRefused(f"lora_path: no {file.name} in {path} (expects PEFT's save_pretrained output)")
    if config_file.stat().st_size > MAX_CONFIG_BYTES:
        raise AdapterRefused(f"lora_path: {config_file} is over {MAX_CONFIG_BYTES} bytes: not an adapter config")
    try:
        config = json.loads(config_file.read_bytes())
    except (OSError, ValueError, RecursionError):  # unreadable, or not JSON: said without its text
        raise AdapterRefused(f"lora_path: {config_file} is unreadable or not JSON") from None
    if not isinstance(config, dict):
        raise AdapterRefused(f"lora_path: {config_file} must hold a JSON object")
    _check_ranks(config, config_file, max_rank)


def _check_ranks(config: dict, config_file: Path, max_rank: int) -> None:
    """The adapter's ``r`` and every ``rank_pattern`` rank are whole numbers in [1, ``max_rank``]."""
    ranks = config.get("rank_pattern") or {}
    if not isinstance(ranks, dict):
        raise AdapterRefused(f"lora_path: {config_file}: rank_pattern must map module names to ranks")
    for key, rank in [("r", config.get("r")), *((f"rank_pattern entry {i}", r) for i, r in enumerate(ranks.values()))]:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= max_rank:
            raise AdapterRefused(
                f"lora_path: {config_file}: {key} must be an integer rank from 1 to {max_rank} (--max-lora-rank)"
            )

"""Weight files: a state dict written as the safetensors directory a model server loads (one file, or
shards with transformers' index), and the config files that make that directory a loadable checkpoint.

Example::

    write_weights(model.state_dict(), "runs/x/engine_weights/v3", "bfloat16")
    copy_config(Path("runs/x/model"), Path("runs/x/engine_weights/v3"))
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from areal_agents.errors import ConfigError

SHARD_BYTES = 5 * 1024**3  # `write_weights`: at most this many bytes a shard (transformers' default)
CONFIG_FILES = ("config.json", "generation_config.json")  # what makes a weights directory a loadable checkpoint


def write_weights(
    state_dict: dict[str, Any], path: str | Path, dtype: str | None = None, shard_bytes: int = SHARD_BYTES
) -> None:
    """``state_dict`` under the directory ``path`` as servers load it (SGLang's ``/update_weights_from_disk``,
    vLLM's ``reload_weights``, serve-model): one ``model.safetensors``, or ``model-0000i-of-0000N.safetensors``
    shards of at most ``shard_bytes`` each with ``model.safetensors.index.json`` (``weight_map``,
    ``total_size``). Floating-point tensors in ``dtype`` (None: as given); tied tensors are stored twice."""
    from safetensors.torch import save_file  # noqa: PLC0415

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = _untie({k: _as(v.detach(), dtype).contiguous().cpu() for k, v in state_dict.items()})
    shards: list[dict[str, Any]] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    for old in [*path.glob("model*.safetensors"), path / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)  # a rewrite with another shard count leaves no stale file behind
    if len(shards) == 1:
        save_file(shards[0], str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
    index = {"metadata": {"total_size": tensor_bytes(tensors)}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def copy_config(model_dir: Path | None, path: Path) -> None:
    """``model_dir``'s config files (`CONFIG_FILES`) into the weights directory ``path``, if any."""
    if model_dir is None:
        return
    for name in CONFIG_FILES:
        if (model_dir / name).is_file():
            shutil.copyfile(model_dir / name, path / name)


def tensor_bytes(state_dict: dict[str, Any]) -> int:
    """Bytes of a state dict's tensors."""
    return sum(t.numel() * t.element_size() for t in state_dict.values())


def _as(t: Any, dtype: str | None) -> Any:
    import torch  # noqa: PLC0415

    if dtype is None or not t.is_floating_point():
        return t
    target = getattr(torch, dtype, None)
    if not isinstance(target, torch.dtype):
        raise ConfigError(f"weight dtype: expects a torch dtype name such as bfloat16, got {dtype!r}")
    return t.to(target)


def _untie(tensors: dict) -> dict:
    """safetensors refuses shared storage (tied embeddings): give each tensor its own."""
    seen: set[int] = set()
    out = {}
    for name, t in tensors.items():
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out

"""Weight sync: how a policy's new weights, and their version, reach the engines that serve it.

A trainer hands over a `WeightSource` (its weights, readable as tensors in this process or written to a
directory); a `WeightSync` moves them to its engines the way those engines load weights, and bumps their
version, so every token generated afterwards carries it. ``engine.weight_sync`` picks one (`open_weight_sync`):

=================  =========================================================================================
`InProcessSync`    ``engine.update_weights(state_dict, version)``: an engine in this process (or its own
                   process, fed through shared memory) swaps the tensors (pause, swap, version, resume)
`DiskSync`         the source writes ``weights_dir/vN`` (safetensors shards in the servers' dtype, the
                   checkpoint's ``config.json``); every server loads it (SGLang's and serve-model's
                   ``/update_weights_from_disk``, vLLM's ``/collective_rpc`` ``reload_weights``); older copies
                   are deleted
`BroadcastSync`    SGLang's ``/init_weights_update_group`` + ``/update_weights_from_distributed``: the trainer
                   broadcasts bucket after bucket to every server (NCCL on GPUs, gloo on CPU; serve-model
                   speaks it over gloo); `engines.broadcast_sync`
=================  =========================================================================================

Every sync times its last push: ``sync.last_push`` holds ``weight_sync_seconds`` and ``weight_sync_bytes``
(the payload written or sent once), which the recipe logs as ``perf/...``. A LoRA policy's sync is `LoraSync`
(`areal_agents.engines.lora_sync`): its source holds one adapter, loaded under the policy's name.

Example::

    sync = InProcessSync([engine])
    await sync.push(policy)  # policy: a WeightSource; the engine serves the new weights as version + 1
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from areal_agents.engines.base import InferenceEngine
from areal_agents.errors import ConfigError

if TYPE_CHECKING:
    from areal_agents.config import EngineConfig

SHARD_BYTES = 5 * 1024**3  # `write_weights`: at most this many bytes a shard (transformers' default)
CONFIG_FILES = ("config.json", "generation_config.json")  # what makes a weights directory a loadable checkpoint


@runtime_checkable
class WeightSource(Protocol):
    """A policy's current weights (the full model, or an adapter), in the form an engine loads."""

    async def tensors(self) -> dict[str, Any]:
        """The weights as a state dict in this process."""
        ...

    async def save_weights(self, path: Path, dtype: str | None = None) -> None:
        """Write the weights to the directory ``path`` with `write_weights` (in ``dtype``; None: as held)."""
        ...


@runtime_checkable
class WeightSync(Protocol):
    """Moves a `WeightSource`'s weights to a set of engines and tags them with a version."""

    last_push: dict[str, float]  # weight_sync_seconds, weight_sync_bytes of the last push

    async def push(self, source: WeightSource, version: int | None = None) -> int:
        """Load the source's weights on every engine as ``version`` (default: the current + 1); return it."""
        ...

    async def announce(self, version: int) -> None:
        """Have every engine tag its tokens with ``version`` without new weights (a resumed run's engines
        start at the checkpoint's weights, under their own version)."""
        ...


class InProcessSync:
    """Weights swapped in place by ``engine.update_weights(state_dict, version)``."""

    def __init__(self, engines: Sequence[InferenceEngine]) -> None:
        self.engines = list(engines)
        self.last_push: dict[str, float] = {}

    async def push(self, source: WeightSource, version: int | None = None) -> int:
        start = time.perf_counter()
        version = self.engines[0].get_version() + 1 if version is None else version
        state_dict = await source.tensors()
        for engine in self.engines:
            await engine.update_weights(state_dict, version)  # pause, swap, version, resume
        self.last_push = timed(start, tensor_bytes(state_dict))
        return version

    async def announce(self, version: int) -> None:
        for engine in self.engines:
            engine.set_version(version)


class DiskEngine(InferenceEngine, Protocol):
    """An engine whose servers load weights from disk (`SGLangEngine`, `VLLMEngine`: a `RemoteEngine`)."""

    def weights_path(self, version: int) -> Path: ...

    async def update_weights_from_disk(self, model_path: str, version: int | None = None) -> None: ...

    def prune_weights(self, version: int) -> None: ...

    async def announce_version(self) -> None: ...


class DiskSync:
    """The source writes the weights of version N under the first engine's ``weights_path(N)`` (in ``dtype``,
    None: as the trainer holds them), with ``model_dir``'s config files beside them so the directory is a
    loadable checkpoint; every engine's servers load it; copies older than N - 1 are deleted (a server
    restarting meanwhile may still read N - 1)."""

    def __init__(
        self, engines: Sequence[DiskEngine], *, dtype: str | None = None, model_dir: str | Path | None = None
    ) -> None:
        self.engines = list(engines)
        self.dtype, self.model_dir = dtype, Path(model_dir) if model_dir else None
        self.last_push: dict[str, float] = {}

    async def push(self, source: WeightSource, version: int | None = None) -> int:
        start = time.perf_counter()
        version = self.engines[0].get_version() + 1 if version is None else version
        path = self.engines[0].weights_path(version)
        if self.dtype is None:
            await source.save_weights(path)
        else:
            await source.save_weights(path, self.dtype)
        copy_config(self.model_dir, path)
        written = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        for engine in self.engines:
            await engine.update_weights_from_disk(str(path), version)  # pause, load, version, resume
        self.engines[0].prune_weights(version)
        self.last_push = timed(start, written)
        return version

    async def announce(self, version: int) -> None:
        for engine in self.engines:
            engine.set_version(version)
            await engine.announce_version()  # fresh servers say "default", not the run's version


def open_weight_sync(cfg: EngineConfig, engine: Any, servers: Any, model_dir: str, dtype: str) -> WeightSync:
    """The `WeightSync` ``engine.weight_sync`` names for ``engine`` (``servers``: the `ServerGroup` behind it,
    None for an engine in this process; ``model_dir``: the checkpoint whose config the servers load;
    ``dtype``: what disk and broadcast send, `wire_dtype`). ``auto``: in_process for an engine in this
    process, else disk."""
    kind = cfg.weight_sync
    if kind == "auto":
        kind = "in_process" if servers is None else "disk"
    if kind == "in_process":
        if servers is not None:
            raise ConfigError("engine.weight_sync=in_process: applies to an engine in this process, not servers")
        return InProcessSync([engine])
    if servers is None:
        raise ConfigError(f"engine.weight_sync={kind}: applies to model servers; this engine runs in this process")
    wire = wire_dtype(cfg, model_dir, dtype)
    if kind == "disk":
        return DiskSync([engine], dtype=wire, model_dir=model_dir)
    if kind == "broadcast":
        if cfg.backend == "vllm":
            raise ConfigError("engine.weight_sync=broadcast: speaks SGLang's protocol (sglang, serve-model), not vllm")
        from areal_agents.engines.broadcast_sync import BroadcastSync  # noqa: PLC0415

        return BroadcastSync(
            [engine],
            dtype=wire,
            bucket_bytes=cfg.weight_sync_bucket_mb * 1024**2,
            timeout_s=cfg.weight_sync_timeout,
            backend="gloo" if cfg.backend == "serve-model" else "auto",  # serve-model receives on its CPU
            tp_size=cfg.tp if cfg.backend == "sglang" else 1,
            supervisor=getattr(servers, "supervisor", None),
        )
    raise ConfigError(f"engine.weight_sync: expects auto, disk, broadcast or in_process, got {kind!r}")


def wire_dtype(cfg: EngineConfig, model_dir: str, dtype: str | None) -> str | None:
    """The dtype new weights travel in to the servers: ``dtype``; ``auto``: the launched servers' own
    (`engine_dtype`: bfloat16 on a GPU, so a trainer's float32 master weights go as half the bytes), except
    serve-model on the CPU, which gets them as the trainer holds them (None)."""
    if dtype not in ("auto", "", None):
        return dtype
    from areal_agents.engines.local_servers import engine_dtype, server_device  # noqa: PLC0415

    if cfg.backend == "serve-model" and server_device(cfg) == "cpu":
        return None
    return engine_dtype(cfg, model_dir, "float32")


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


def timed(start: float, nbytes: int) -> dict[str, float]:
    """A push's ``last_push``: seconds since ``start`` (`time.perf_counter`) and bytes moved."""
    return {"weight_sync_seconds": time.perf_counter() - start, "weight_sync_bytes": float(nbytes)}


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

"""Weight sync: how a policy's new weights, and their version, reach the engines that serve it.

A trainer hands over a `WeightSource` (its weights, readable as tensors in this process or written to a
directory); a `WeightSync` moves them to its engines the way those engines load weights, and bumps their
version, so every token generated afterwards carries it. ``engine.weight_sync`` picks one
(`engines.local_servers.open_weight_sync`); the weights travel as files by `models.weight_files`:

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

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from areal_agents.engines.base import InferenceEngine
from areal_agents.engines.weight_sender import HeldWeights, WeightSender
from areal_agents.models.weight_files import (  # noqa: F401  (the writer's old home re-exports it)
    CONFIG_FILES,
    SHARD_BYTES,
    copy_config,
    tensor_bytes,
    write_weights,
)


@runtime_checkable
class WeightSource(Protocol):
    """A policy's current weights (the full model, or an adapter), in the form an engine loads."""

    async def tensors(self) -> dict[str, Any]:
        """The weights as a state dict in this process."""
        ...

    async def save_weights(self, path: Path, dtype: str | None = None) -> None:
        """Write the weights to the directory ``path`` with `write_weights` (in ``dtype``; None: as held)."""
        ...

    def weight_sender(self) -> WeightSender:
        """Rank 0 of a weight broadcast, where the weights live (one per source: it keeps its groups);
        `HeldWeights` gives a source in this process its `LocalSender`."""
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


class StateDictSource(HeldWeights):
    """A state dict in this process as a `WeightSource` (a `RemoteEngine`'s own ``update_weights``)."""

    def __init__(self, state_dict: dict[str, Any]) -> None:
        self.state_dict = state_dict

    async def tensors(self) -> dict[str, Any]:
        return self.state_dict

    async def save_weights(self, path: Path, dtype: str | None = None) -> None:
        await asyncio.to_thread(write_weights, self.state_dict, path, dtype)


def timed(start: float, nbytes: int) -> dict[str, float]:
    """A push's ``last_push``: seconds since ``start`` (`time.perf_counter`) and bytes moved."""
    return {"weight_sync_seconds": time.perf_counter() - start, "weight_sync_bytes": float(nbytes)}

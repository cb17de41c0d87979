"""Adapter-only weight sync: a LoRA policy's push moves its adapter, not the model, to the engine serving it.

Several LoRA policies (one per agent) share one base model on one engine: each policy's rollouts go through
an `AdapterView` of that engine, which names the policy's adapter on every request, and each policy's
`LoraSync` loads its adapter under its name. An engine in this process (no ``weights_dir``) takes the tensors
(``set_lora_adapter``); model servers load PEFT's directory, written under the engine's ``weights_dir``
(``load_lora_adapter``: serve-model's and SGLang's ``/load_lora_adapter``, vLLM's ``/v1/load_lora_adapter``).

Versions: each adapter counts its own pushes; the engine's version, which tags every token and gates
staleness, is the oldest adapter's (`LoraGroup`), so no token is ever tagged newer than its adapter.

    group = LoraGroup(engine)
    view, sync = group.view("debater_0"), group.sync("debater_0")
    await sync.push(policy)          # policy: a WeightSource whose tensors are its adapter
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any, Protocol

from areal_agents.engines.base import InferenceEngine, LoraEngine
from areal_agents.engines.weight_sync import WeightSource, tensor_bytes, timed
from areal_agents.errors import ConfigError
from areal_agents.types import GenRequest, GenResponse


class AdapterSource(WeightSource, Protocol):
    """A LoRA policy's weights: `tensors` and `save_weights` give its adapter; this gives its config."""

    def adapter_config(self) -> dict[str, Any] | None: ...


class LoraGroup:
    """The LoRA policies served by one engine: their adapters' versions, their views, who has closed."""

    def __init__(self, engine: LoraEngine, weights_dir: str | Path | None = None) -> None:
        self.engine = engine
        self.versions: dict[str, int] = {}
        self.open_views: set[str] = set()
        self.weights_dir = Path(weights_dir) if weights_dir else engine.weights_dir

    def view(self, name: str) -> AdapterView:
        self.open_views.add(name)
        return AdapterView(self, name)

    def sync(self, name: str) -> LoraSync:
        return LoraSync(self, name)

    def engine_version(self, name: str | None = None, version: int | None = None) -> int:
        """The oldest adapter's version (with ``name`` at ``version``, as after a push that succeeds)."""
        versions = self.versions if name is None else {**self.versions, name: version}
        return min(versions.values())


class AdapterView(InferenceEngine):
    """The engine as one LoRA policy sees it: every request names the policy's adapter; the rest is the
    engine's (its version is the group's oldest adapter's). Closing the last view closes the engine."""

    def __init__(self, group: LoraGroup, name: str) -> None:
        self.group, self.lora_name = group, name

    async def agenerate(self, request: GenRequest) -> GenResponse:
        if request.lora_name is None:
            request.lora_name = self.lora_name
        return await self.group.engine.agenerate(request)

    async def pause(self) -> None:
        await self.group.engine.pause()

    async def resume(self) -> None:
        await self.group.engine.resume()

    async def update_weights(self, state_dict: dict[str, Any], version: int | None = None) -> None:
        raise ConfigError(f"policy {self.lora_name!r} trains a LoRA adapter: its weights reach the engine by LoraSync")

    def get_version(self) -> int:
        return self.group.engine.get_version()

    def set_version(self, version: int) -> None:
        self.group.engine.set_version(version)

    def max_context(self) -> int | None:
        return self.group.engine.max_context()

    async def counters(self) -> dict[str, float]:
        return await self.group.engine.counters()

    def close(self) -> None:
        """Nothing of its own: the engine closes with its last view (`aclose`)."""

    async def aclose(self) -> None:
        self.group.open_views.discard(self.lora_name)
        if not self.group.open_views:
            await self.group.engine.aclose()


class LoraSync:
    """A `WeightSync` that loads one policy's adapter on the group's engine under the policy's name."""

    def __init__(self, group: LoraGroup, name: str) -> None:
        self.group, self.name = group, name
        self.last_push: dict[str, float] = {}

    async def push(self, source: AdapterSource, version: int | None = None) -> int:
        """Load the source's adapter as this policy's version ``version`` (default: its last + 1). A refused
        adapter leaves the served one and every version as they were."""
        start = time.perf_counter()
        group, engine = self.group, self.group.engine
        if version is None:
            version = group.versions.get(self.name, engine.get_version()) + 1
        config = source.adapter_config()
        if config is None:
            raise ConfigError(f"policy {self.name!r}: LoraSync pushes adapters, and this policy trains full weights")
        engine_version = group.engine_version(self.name, version)
        if group.weights_dir is None:  # an engine in this process (or its own, over a pipe): the tensors
            tensors = await source.tensors()
            await engine.set_lora_adapter(self.name, tensors, config, engine_version)
            group.versions[self.name] = version
            self.last_push = timed(start, tensor_bytes(tensors))
            return version
        path = self._adapter_dir(version)
        await source.save_weights(path)
        await engine.load_lora_adapter(self.name, str(path), engine_version)
        group.versions[self.name] = version
        self._prune(version)
        self.last_push = timed(start, sum(f.stat().st_size for f in path.glob("*.safetensors")))
        return version

    async def announce(self, version: int) -> None:
        """Tag the engine's tokens with ``version``; the adapter itself comes with a `push` of that version."""
        self.group.versions[self.name] = version
        self.group.engine.set_version(self.group.engine_version())

    def _adapter_dir(self, version: int) -> Path:
        return self.group.weights_dir / "lora" / self.name / f"v{version}"

    def _prune(self, version: int) -> None:
        """Delete adapters older than the one before ``version`` (a restarting server may read that one)."""
        for old in self._adapter_dir(version).parent.glob("v*"):
            if old.name[1:].isdigit() and int(old.name[1:]) < version - 1:
                shutil.rmtree(old, ignore_errors=True)

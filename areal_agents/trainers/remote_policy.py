"""`RemotePolicy`: a `TrainablePolicy` whose trainer runs elsewhere, reached through a `TrainerTransport`:
spawned processes over pipes (`areal_agents.trainers.trainer_process.PipeTransport`, ``ppo.trainer: process``
or ``ppo.nproc_per_node`` > 1) or Ray rank actors (`areal_agents.cluster.trainer_group.RayTransport`).

The proxy is written once; a transport only carries named calls to a `TrainerEndpoint` on every rank and
brings rank 0's answer back. Checkpoints and weight files are written there, where the weights live.

Example::

    policy = RemotePolicy("policy", spec, serving, PipeTransport.spawn(spec, "policy", path, path))
    stats = await policy.update(trajectories, generator)
    await policy.push_weights()
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from areal_agents.engines.serving import Serving
from areal_agents.engines.weight_sender import GroupSpec, WireWeights
from areal_agents.trainers.policy_api import TrainSpec
from areal_agents.types import Trajectory


class TrainerTransport(Protocol):
    """Carries calls to the `TrainerEndpoint` of every rank of one trainer.

    ``streams``: True when the trainer takes a batch in parts (one unsharded process); ranks take it whole.
    """

    streams: bool

    def call(self, method: str, *args: Any) -> Any:
        """``method(*args)`` on every rank, blocking; rank 0's answer (or the first rank's error)."""
        ...

    async def acall(self, method: str, *args: Any) -> Any:
        """`call` without blocking the event loop."""
        ...

    async def weights(self) -> dict[str, torch.Tensor]:
        """The trainer's current full weights (a LoRA policy's adapter), readable here until the next call."""
        ...

    async def wait_idle(self) -> None:
        """Return when no call is in flight (one abandoned by a signal may still be computing)."""
        ...

    def close(self) -> None:
        """Stop every rank."""
        ...


class TrainerSender:
    """A `WeightSender` in the trainer: its rank 0 (a `TrainerEndpoint`) hosts the weight groups and sends the
    buckets from where the weights are; this process only relays the calls."""

    def __init__(self, transport: TrainerTransport) -> None:
        self.transport = transport

    async def describe(self, dtype: str | None, backend: str) -> WireWeights:
        return await self.transport.acall("describe_weights", dtype, backend)

    async def join(self, spec: GroupSpec) -> None:
        await self.transport.acall("join_weight_group", spec)

    async def send(self, group: str, names: list[str]) -> None:
        await self.transport.acall("send_weights", group, names)

    def leave(self, group: str) -> None:
        """Best effort: a trainer that is gone has left every group (its peers' waits have failed)."""
        try:
            self.transport.call("leave_weight_group", group)
        except Exception:  # noqa: BLE001  (the trainer's death is reported by the call that found it)
            pass


class RemotePolicy:
    """A `TrainablePolicy` trained behind ``transport``, generating on ``serving``'s engine; ``serving.sync``
    moves the trainer's weights to it (`tensors` or `save_weights`)."""

    def __init__(self, name: str, spec: TrainSpec, serving: Serving, transport: TrainerTransport) -> None:
        self.name, self.transport = name, transport
        self.engine, self.weight_sync, self.servers = serving.engine, serving.sync, serving.servers
        self.streams = transport.streams
        self.lora = spec.lora is not None
        self._adapter_config: dict[str, Any] | None = None  # a LoRA policy's, once asked
        self._parts: list[Trajectory] = []  # without streaming: the parts of the batch `finish_update` trains
        self._sender = TrainerSender(transport)

    async def update(self, trajectories: list[Trajectory], generator: torch.Generator) -> dict[str, float]:
        version = self.engine.get_version()  # the mismatch metrics' tokens (`Policy.version`)
        stats, state = await self.transport.acall("update", trajectories, generator.get_state(), version)
        generator.set_state(state)
        return stats

    async def update_part(self, trajectories: list[Trajectory]) -> None:
        """Forward and backward on part of a batch in the trainer (`Policy.update_part`); without streaming
        (ranks take a batch only whole) the part waits for `finish_update`."""
        if not self.streams:
            self._parts.extend(trajectories)
            return
        await self.transport.acall("update_part", trajectories, self.engine.get_version())

    async def finish_update(self, generator: torch.Generator) -> dict[str, float]:
        """The step of the parts fed so far (without streaming: one `update` of them all)."""
        if not self.streams:
            parts, self._parts = self._parts, []
            return await self.update(parts, generator)
        stats, state = await self.transport.acall("finish_update", generator.get_state())
        generator.set_state(state)
        return stats

    async def wait_idle(self) -> None:
        await self.transport.wait_idle()

    async def push_weights(self) -> None:
        """The trainer's weights to the engine through ``weight_sync`` (pause, swap, version + 1, resume)."""
        await self.weight_sync.push(self)

    async def tensors(self) -> dict[str, torch.Tensor]:
        """The trainer's current weights, as the transport brings them (a `WeightSource`)."""
        return await self.transport.weights()

    async def save_weights(self, path: Path, dtype: str | None = None) -> None:
        """The trainer writes its weights under ``path`` (in ``dtype``; a LoRA policy's adapter as PEFT's
        directory; a `WeightSource`): rank 0 writes, this process copies nothing."""
        await self.transport.acall("save_weights", path, dtype)

    def weight_sender(self) -> TrainerSender:
        """The trainer's rank 0 broadcasts its weights to the servers itself (`BroadcastSync`)."""
        return self._sender

    def adapter_config(self) -> dict[str, Any] | None:
        """A LoRA policy's ``adapter_config.json`` content (None: full weights); it never changes, so it is
        asked of the trainer once."""
        if self.lora and self._adapter_config is None:
            self._adapter_config = self.transport.call("adapter_config")
        return self._adapter_config

    def save_checkpoint(self, path: Path) -> None:
        """The trainer writes its weights under ``path`` (`Policy.save_checkpoint`; with ranks, each gathers and
        rank 0 writes): this process never holds a copy of the model."""
        self.transport.call("save_checkpoint", path)

    def save_train_state(self, path: Path, key: str | None = None) -> None:
        """The trainer adds its train state to the checkpoint's state file (`Policy.save_train_state`; with ranks,
        each gathers and rank 0 writes): the optimizer state never comes to this process."""
        self.transport.call("save_train_state", path, key)

    def state_dict(self) -> dict[str, Any]:
        """The full train state (single-process layout: any world size resumes it)."""
        return self.transport.call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.transport.call("load_state_dict", state)

    def load_train_state(self, path: Path, key: str | None = None) -> None:
        """The trainer reads its train state from the checkpoint at ``path`` (`Policy.load_train_state`): the
        optimizer state never comes to this process."""
        self.transport.call("load_train_state", path, key)

    def close(self) -> None:
        """Stop the trainer and the servers launched for the engine (the engine client is closed apart)."""
        self.transport.close()
        if self.servers is not None:
            self.servers.stop()

"""`WeightSender`: rank 0 of a weight-broadcast group, run where the weights live.

`BroadcastSync` (in the run's process) tells the servers what comes and asks a sender to send it, bucket by
bucket. `LocalSender` sends tensors held in this process (a trainer thread's); a trainer in processes of its
own sends its weights there (`areal_agents.trainers.remote_policy`: its rank 0 runs a `TensorSender`), so the
weights never pass through the run's process, and go out over NCCL from the GPU they are on.

    sender = LocalSender(policy)
    wire = await sender.describe(dtype="bfloat16", backend="auto")
    await sender.join(GroupSpec("10.0.0.1", 29600, 3, "areal_weights_1_ab12", wire.backend, 120.0))
    await sender.send("areal_weights_1_ab12", ["model.embed_tokens.weight"])
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from areal_agents.engines.broadcast_group import WeightGroup, join_group
from areal_agents.errors import EngineError
from areal_agents.models.weight_checks import finite


@dataclass(frozen=True)
class GroupSpec:
    """A weight group for the sender to host as rank 0 (`join_group`'s arguments)."""

    master_address: str
    master_port: int
    world_size: int
    name: str
    backend: str
    timeout_s: float


@dataclass(frozen=True)
class WireWeights:
    """What a push sends: each tensor as sent (on the meta device: dtype and shape), those with a NaN or an
    infinity as sent, and the group backend the sender will use (NCCL from a GPU)."""

    wire: dict[str, torch.Tensor]
    nonfinite: list[str]
    backend: str


class WeightSender(Protocol):
    """Rank 0 of the weight groups of one source; `BroadcastSync` drives it."""

    async def describe(self, dtype: str | None, backend: str) -> WireWeights:
        """Take the current weights for the push that starts; what will be sent (``dtype`` None: as held;
        ``backend``: ``auto``, ``gloo`` or ``nccl``)."""
        ...

    async def join(self, spec: GroupSpec) -> None:
        """Host group ``spec`` as rank 0; returns when every rank joined (raises past its timeout)."""
        ...

    async def send(self, group: str, names: list[str]) -> None:
        """Broadcast the named tensors of the described weights, in order, to group ``group``."""
        ...

    def leave(self, group: str) -> None:
        """Leave group ``group`` (peers still waiting in it fail at once); unknown names are ignored."""
        ...


class TensorSender:
    """The sending rank's work on tensors in its own process (synchronous: run it off any event loop)."""

    def __init__(self) -> None:
        self.groups: dict[str, WeightGroup] = {}
        self.tensors: dict[str, Any] = {}
        self.dtype: torch.dtype | None = None
        self.backend = "gloo"

    def describe(self, tensors: dict[str, Any], dtype: str | None, backend: str, device: str) -> WireWeights:
        """Hold ``tensors`` (on ``device``: ``cuda`` sends over NCCL under ``auto``) for this push's buckets."""
        if backend not in ("auto", "gloo", "nccl"):
            raise EngineError(f"weight broadcast backend: expects auto, gloo or nccl, got {backend!r}")
        self.tensors, self.dtype = tensors, getattr(torch, dtype) if dtype is not None else None
        self.backend = backend if backend != "auto" else ("nccl" if device == "cuda" else "gloo")
        wire = {name: self.wire(t, "meta") for name, t in tensors.items()}
        nonfinite = [name for name, t in tensors.items() if not finite(t, wire[name].dtype)]
        return WireWeights(wire, nonfinite, self.backend)

    def join(self, spec: GroupSpec) -> None:
        self.leave(spec.name)
        self.groups[spec.name] = join_group(
            spec.master_address, spec.master_port, rank=0, world_size=spec.world_size, group_name=spec.name,
            backend=spec.backend, timeout_s=spec.timeout_s,
        )  # fmt: skip

    def send(self, group: str, names: list[str]) -> None:
        """The bucket ``names``, converted one bucket at a time (a GPU holds one bucket's copy at most)."""
        weight_group = self.groups[group]
        bucket = [self.wire(self.tensors[n], weight_group.backend) for n in names]
        for t in bucket:
            weight_group.broadcast(t)

    def leave(self, group: str) -> None:
        weight_group = self.groups.pop(group, None)
        if weight_group is not None:
            weight_group.close()

    def wire(self, t: Any, backend: str) -> torch.Tensor:
        """A tensor as it is broadcast: in ``dtype`` (floating point only), on the backend's device (gloo: the
        CPU; nccl: the GPU; ``meta``: its dtype and shape only)."""
        dtype = self.dtype if self.dtype is not None and t.is_floating_point() else t.dtype
        if backend == "meta":
            return torch.empty(t.shape, dtype=dtype, device="meta")
        device = "cuda" if backend == "nccl" else "cpu"
        return t.detach().to(device=device, dtype=dtype).contiguous()


class LocalSender:
    """A `WeightSender` of a `WeightSource` in this process (its ``tensors()``)."""

    def __init__(self, source: Any) -> None:
        self.source, self.sender = source, TensorSender()

    async def describe(self, dtype: str | None, backend: str) -> WireWeights:
        tensors = await self.source.tensors()
        first = next(iter(tensors.values()), None)
        device = "cuda" if first is not None and first.is_cuda else "cpu"
        return self.sender.describe(tensors, dtype, backend, device)

    async def join(self, spec: GroupSpec) -> None:
        await asyncio.to_thread(self.sender.join, spec)

    async def send(self, group: str, names: list[str]) -> None:
        await asyncio.to_thread(self.sender.send, group, names)

    def leave(self, group: str) -> None:
        self.sender.leave(group)


class HeldWeights:
    """A base for a `WeightSource` whose tensors are in this process: its `weight_sender` is one `LocalSender`."""

    _weight_sender: LocalSender | None = None

    def weight_sender(self) -> WeightSender:
        if self._weight_sender is None:
            self._weight_sender = LocalSender(self)
        return self._weight_sender

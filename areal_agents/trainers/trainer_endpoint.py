"""`TrainerEndpoint`: the trainer's side of a `RemotePolicy`, one rank's `Policy` (or the only one) answering
the calls a transport brings (a pipe from the driver, a Ray actor method).

Every rank gets every call: each takes its share of an update, and gathers (collectives need all). Rank 0's
answer is the one the driver uses, and rank 0 writes the files, so the driver never holds the model.

Example::

    endpoint = TrainerEndpoint(load_trainable("policy", spec, model_path, model_path))
    stats, state = endpoint.call("update", (trajectories, generator.get_state(), version))
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from areal_agents.engines.weight_sender import GroupSpec, TensorSender, WireWeights
from areal_agents.models.weight_files import write_weights
from areal_agents.trainers.lora import write_adapter
from areal_agents.trainers.policy import Policy
from areal_agents.types import Trajectory


class UnknownTrainerCall(ValueError):
    """A transport brought a call the endpoint does not answer."""


class TrainerEndpoint:
    """Answers `RemotePolicy`'s calls with ``policy`` (one rank's, when FSDP2-sharded). ``shared``: a copy of
    the weights in shared memory that ``publish`` refreshes (a trainer process's; None: ``weights`` answers them)."""

    def __init__(self, policy: Policy, shared: dict[str, torch.Tensor] | None = None) -> None:
        self.policy, self.shared = policy, shared
        self.rank = policy.dp.rank if policy.dp is not None else 0
        self.calls: dict[str, Callable[..., Any]] = {
            "update": self.update,
            "update_part": policy.train_part,
            "finish_update": policy.remote_finish_step,
            "publish": self.publish,
            "weights": policy.weights,
            "save_weights": self.save_weights,
            "adapter_config": policy.adapter_config,
            "save_checkpoint": self.save_checkpoint,
            "save_train_state": self.save_train_state,
            "state_dict": policy.state_dict,
            "load_state_dict": policy.load_state_dict,
            "load_train_state": policy.load_train_state,
            "describe_weights": self.describe_weights,
            "join_weight_group": self.join_weight_group,
            "send_weights": self.send_weights,
            "leave_weight_group": self.leave_weight_group,
        }
        self.sender = TensorSender()  # rank 0 of the weight broadcasts to the servers (`BroadcastSync`)

    def call(self, method: str, args: tuple) -> Any:
        """``method(*args)``; `UnknownTrainerCall` for a name it does not answer."""
        if method not in self.calls:
            raise UnknownTrainerCall(f"the trainer answers {sorted(self.calls)}, not {method!r}")
        return self.calls[method](*args)

    def update(
        self, trajectories: list[Trajectory], generator_state: torch.Tensor, version: int | None
    ) -> tuple[dict[str, float], torch.Tensor]:
        """One PPO update (this rank's share); the stats and the generator's state after it."""
        return self.policy.remote_train_step(trajectories, generator_state, None, version)

    @torch.no_grad()
    def publish(self) -> None:
        """The current weights into ``shared`` (every rank gathers; rank 0 holds the shared copy)."""
        for key, value in self.policy.weights().items():
            self.shared[key].copy_(value)

    def save_weights(self, path: Path, dtype: str | None = None) -> None:
        """The full weights under ``path`` by `write_weights` (in ``dtype``), a LoRA policy's adapter as PEFT's
        directory: every rank gathers, rank 0 writes (the directory model servers load from)."""
        adapter = self.policy.adapter
        if adapter is not None:
            tensors, config = adapter.tensors(), adapter.config()
            if self.rank == 0:
                write_adapter(path, tensors, config)
            return
        weights = self.policy.weights()
        if self.rank == 0:
            write_weights(weights, path, dtype)

    def describe_weights(self, dtype: str | None, backend: str) -> WireWeights | None:
        """The current weights for a broadcast push (every rank gathers; rank 0 keeps them and answers)."""
        weights = self.policy.weights()
        if self.rank != 0:
            return None
        device = next(self.policy.model.parameters()).device.type
        return self.sender.describe(weights, dtype, backend, device)

    def join_weight_group(self, spec: GroupSpec) -> None:
        """Rank 0 hosts the servers' weight group `spec` (the servers join it at the same time)."""
        if self.rank == 0:
            self.sender.join(spec)

    def send_weights(self, group: str, names: list[str]) -> None:
        """Rank 0 broadcasts a bucket of the described weights from its device to the servers."""
        if self.rank == 0:
            self.sender.send(group, names)

    def leave_weight_group(self, group: str) -> None:
        if self.rank == 0:
            self.sender.leave(group)

    def save_checkpoint(self, path: Path) -> None:
        self.policy.save_checkpoint(Path(path))

    def save_train_state(self, path: Path, key: str | None = None) -> None:
        self.policy.save_train_state(Path(path), key)

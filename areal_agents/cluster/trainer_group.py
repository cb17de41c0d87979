"""A data-parallel trainer as a group of Ray actors (a torch.distributed gloo group; the trainer computes
on CPU), and `DistributedPolicy`, the driver's handle: a `TrainablePolicy`
(`areal_agents.trainers.policy_api`) like the local ones.

Every rank loads the same weights and receives the whole batch; `ppo_update` with a `DataParallel`
gives each rank a token-balanced share of the micro-batches and sums gradients, so all ranks take the
single-process trainer's step. Rank 0 writes the weights the model servers load and the checkpoints.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import ray
import torch
from transformers import PreTrainedModel

from areal_agents.engines.base import InferenceEngine
from areal_agents.engines.weight_sync import WeightSync, write_weights
from areal_agents.models.loading import load_model, quiet_transformers
from areal_agents.net import free_port
from areal_agents.trainers.distributed import DataParallel
from areal_agents.trainers.policy import load_trainable
from areal_agents.trainers.policy_api import TrainSpec
from areal_agents.trainers.run_start import seed_everything
from areal_agents.types import Trajectory


@ray.remote
class TrainerRank:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.policy = self.dp = None

    def master_address(self) -> str:
        """``host:port`` for the process group (asked of rank 0)."""
        host = ray.util.get_node_ip_address()
        return f"{host}:{free_port(host)}"

    def setup(self, spec: TrainSpec, name: str, model_path: str, init_path: str, master: str) -> None:
        quiet_transformers()
        self.dp = DataParallel.init(self.rank, self.world_size, master, "gloo")  # the trainer computes on CPU
        seed_everything(spec.seed)
        self.policy = load_trainable(name, spec, model_path, init_path)
        self.dp.broadcast_parameters(self.policy.model)
        if self.policy.critic is not None:
            self.dp.broadcast_parameters(self.policy.critic)

    def update(self, trajectories: list[Trajectory], generator_state: torch.Tensor) -> tuple[dict, Any]:
        return self.policy.remote_train_step(trajectories, generator_state, self.dp)

    def write_weights(self, path: str) -> None:
        write_weights(self.policy.model.state_dict(), path)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.policy.model.state_dict().items()}

    def train_state(self) -> dict[str, Any]:
        return self.policy.state_dict()

    def load_train_state(self, state: dict[str, Any]) -> None:
        self.policy.load_state_dict(state)

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        if self.dp is not None:
            self.dp.close()


class DistributedPolicy:
    """A `TrainablePolicy` trained on ``ranks`` rank actors (``cpus`` each) and served by model-server
    actors behind ``engine``; ``weight_sync`` has the servers load what rank 0 writes (`DiskSync`).

    Example::

        policy = DistributedPolicy("policy", spec, path, path, engine, DiskSync([engine]), servers, ranks=2)
        stats = await policy.update(trajectories, generator)
    """

    streams = False  # each rank takes the whole batch at once (no `update_part`)

    def __init__(
        self,
        name: str,
        spec: TrainSpec,
        model_path: str,
        init_path: str,
        engine: InferenceEngine,
        weight_sync: WeightSync,
        servers: Any,
        ranks: int = 1,
        cpus: float = 1.0,
    ) -> None:
        self.name, self.engine, self.weight_sync, self.servers = name, engine, weight_sync, servers
        self.model_path, self.dtype = model_path, spec.dtype
        self.ranks = [TrainerRank.options(num_cpus=cpus).remote(rank, ranks) for rank in range(ranks)]
        master = ray.get(self.ranks[0].master_address.remote())
        ray.get([r.setup.remote(spec, name, model_path, init_path, master) for r in self.ranks])
        self._model: PreTrainedModel | None = None

    async def update(self, trajectories: list[Trajectory], generator: torch.Generator) -> dict[str, float]:
        batch = ray.put(trajectories)  # one copy in the object store, read by every rank
        results = await asyncio.gather(*(r.update.remote(batch, generator.get_state()) for r in self.ranks))
        stats, state = results[0]
        generator.set_state(state)
        return stats

    async def push_weights(self) -> None:
        """Rank 0 writes the new weights; the servers load them (pause, swap, version + 1, resume)."""
        await self.weight_sync.push(self)

    async def tensors(self) -> dict[str, torch.Tensor]:
        """Rank 0's current weights, copied to this process (a `WeightSource`)."""
        return await self.ranks[0].state_dict.remote()

    async def save_weights(self, path: Path) -> None:
        """Rank 0 writes its weights as ``path/model.safetensors`` (a `WeightSource`)."""
        await self.ranks[0].write_weights.remote(str(path))

    async def wait_idle(self) -> None:
        """Nothing to wait for: an update is one call, awaited by the recipe."""

    @property
    def model(self) -> PreTrainedModel:
        """A copy of rank 0's current weights in the driver (for checkpoints)."""
        if self._model is None:
            self._model = load_model(self.model_path, self.dtype)
        self._model.load_state_dict(ray.get(self.ranks[0].state_dict.remote()))
        return self._model

    def state_dict(self) -> dict[str, Any]:
        return ray.get(self.ranks[0].train_state.remote())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ray.get([r.load_train_state.remote(state) for r in self.ranks])

    def close(self) -> None:
        """Stop the rank actors and the model servers (again: nothing)."""
        for rank in self.ranks:
            try:
                ray.get(rank.close.remote(), timeout=30)
            except (ray.exceptions.RayError, TimeoutError):
                pass
            ray.kill(rank)
        self.ranks = []
        if self.servers is not None:
            self.servers.stop()

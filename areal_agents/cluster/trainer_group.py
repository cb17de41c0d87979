"""A data-parallel trainer as a group of Ray actors (a torch.distributed gloo group; the trainer computes
on CPU), and `DistributedPolicy`, the driver's handle with the interface of a local `Policy`.

Every rank loads the same weights and receives the whole batch; `ppo_update` with a `DataParallel`
gives each rank a token-balanced share of the micro-batches and sums gradients, so all ranks take the
single-process trainer's step. Rank 0 writes the weights the model servers load and the checkpoints.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import ray
import torch
from transformers import PreTrainedModel

from areal_agents.config import TrainConfig
from areal_agents.engines.sglang.client import SGLangEngine, write_weights
from areal_agents.models.loading import load_model, quiet_transformers
from areal_agents.net import free_port
from areal_agents.trainers.distributed import DataParallel
from areal_agents.trainers.policy import load_trainable
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

    def setup(self, cfg: TrainConfig, name: str, model_path: str, init_path: str, master: str) -> None:
        quiet_transformers()
        self.dp = DataParallel.init(self.rank, self.world_size, master, "gloo")  # the trainer computes on CPU
        seed_everything(cfg.seed)
        self.cfg = cfg
        self.policy = load_trainable(name, cfg, model_path, init_path)
        self.dp.broadcast_parameters(self.policy.model)
        if self.policy.critic is not None:
            self.dp.broadcast_parameters(self.policy.critic)

    def update(self, trajectories: list[Trajectory], pad: int, generator_state: torch.Tensor) -> tuple[dict, Any]:
        return self.policy.remote_train_step(trajectories, self.cfg, pad, generator_state, self.dp)

    def write_weights(self, path: str) -> None:
        write_weights(self.policy.model.state_dict(), path)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu() for k, v in self.policy.model.state_dict().items()}

    def train_state(self) -> dict[str, Any]:
        return self.policy.train_state()

    def load_train_state(self, state: dict[str, Any]) -> None:
        self.policy.load_train_state(state)

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        if self.dp is not None:
            self.dp.close()


class DistributedPolicy:
    """What the RL recipe needs of a policy (`update`, `push_weights`, `model`, train state), with the
    training on ``cfg.ray.trainer_ranks`` rank actors and generation on model-server actors."""

    def __init__(self, name: str, cfg: TrainConfig, model_path: str, init_path: str, engine: SGLangEngine, servers):
        self.name, self.engine, self.servers = name, engine, servers
        self.model_path = model_path
        n, options = cfg.ray.trainer_ranks, {"num_cpus": cfg.ray.trainer_cpus}
        self.ranks = [TrainerRank.options(**options).remote(rank, n) for rank in range(n)]
        master = ray.get(self.ranks[0].master_address.remote())
        ray.get([r.setup.remote(cfg, name, model_path, init_path, master) for r in self.ranks])
        self._model: PreTrainedModel | None = None

    async def update(
        self, trajectories: list[Trajectory], cfg: TrainConfig, pad_token_id: int, generator: torch.Generator
    ) -> dict[str, float]:
        batch = ray.put(trajectories)  # one copy in the object store, read by every rank
        results = await asyncio.gather(
            *(r.update.remote(batch, pad_token_id, generator.get_state()) for r in self.ranks)
        )
        stats, state = results[0]
        generator.set_state(state)
        return stats

    async def push_weights(self) -> None:
        """Rank 0 writes the new weights; the servers load them (pause, swap, version + 1, resume)."""
        version = self.engine.get_version() + 1
        path = self.engine.weights_path(version)
        await self.ranks[0].write_weights.remote(str(path))
        await self.engine.update_weights_from_disk(str(path), version)
        self.engine.prune_weights(version)

    @property
    def model(self) -> PreTrainedModel:
        """A copy of rank 0's current weights in the driver (for checkpoints)."""
        if self._model is None:
            self._model = load_model(self.model_path)
        self._model.load_state_dict(ray.get(self.ranks[0].state_dict.remote()))
        return self._model

    def train_state(self) -> dict[str, Any]:
        return ray.get(self.ranks[0].train_state.remote())

    def load_train_state(self, state: dict[str, Any]) -> None:
        ray.get([r.load_train_state.remote(state) for r in self.ranks])

    def close(self) -> None:
        for rank in self.ranks:
            try:
                ray.get(rank.close.remote(), timeout=30)
            except (ray.exceptions.RayError, TimeoutError):
                pass
            ray.kill(rank)

"""An FSDP2 trainer as a group of Ray actors (a torch.distributed group: gloo on CPU, NCCL when each rank
reserves a GPU, ``ray.trainer_gpus`` > 0), and `DistributedPolicy`, the driver's handle: a
`TrainablePolicy` (`areal_agents.trainers.policy_api`) like the local ones.

Each rank is set up as a local rank process is (`load_trainable` with its `DataParallel`: the models
sharded per layer, `fsdp.py`) and receives the whole batch; `ppo_update` gives each rank a token-balanced,
padded share of the micro-batches and sums gradients, so all ranks take the single-process trainer's step.
Full weights and train state are gathered by all ranks; rank 0 writes the weights the model servers load
and the checkpoints' model and train state. NCCL between Ray actors has not run here (no GPUs): CI runs gloo.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import ray
import torch

from areal_agents.engines.base import InferenceEngine
from areal_agents.engines.weight_sync import WeightSync
from areal_agents.models.device import resolve_device
from areal_agents.models.loading import quiet_transformers
from areal_agents.models.weight_files import write_weights
from areal_agents.net import free_port
from areal_agents.trainers.distributed import DataParallel
from areal_agents.trainers.lora import write_adapter
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
        """Join the group (NCCL on the GPU Ray gave this actor, else gloo) and load this rank's shards."""
        quiet_transformers()
        device = resolve_device(spec.ppo.device, local_rank=0)  # Ray shows an actor only its own GPUs
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.dp = DataParallel.init(self.rank, self.world_size, master, backend)
        self.dp.device = device
        seed_everything(spec.seed)
        self.policy = load_trainable(name, spec, model_path, init_path, self.dp)

    def update(
        self, trajectories: list[Trajectory], generator_state: torch.Tensor, version: int | None = None
    ) -> tuple[dict, Any]:
        return self.policy.remote_train_step(trajectories, generator_state, None, version)

    def write_weights(self, path: str, dtype: str | None = None) -> None:
        """Gather the full weights (every rank calls it); rank 0 writes them (a LoRA policy: its adapter)."""
        if self.policy.adapter is not None:
            tensors, config = self.adapter_state()  # every rank gathers
            if self.rank == 0:
                write_adapter(path, tensors, config)
            return
        weights = self.policy.weights()
        if self.rank == 0:
            write_weights(weights, path, dtype)

    def adapter_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
        """A LoRA policy's adapter: its tensors and config (None: full weights); every rank gathers (call it on all)."""
        adapter = self.policy.adapter
        return (adapter.tensors(), adapter.config()) if adapter is not None else None

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights, gathered by every rank; rank 0's are the answer (``{}`` elsewhere)."""
        return self.policy.weights()

    def save_checkpoint(self, path: str) -> None:
        """Gather the full weights (every rank calls it); rank 0 writes the checkpoint's model directory."""
        self.policy.save_checkpoint(Path(path))

    def save_train_state(self, path: str, key: str | None) -> None:
        """Gather the full train state (every rank calls it); rank 0 adds it to the checkpoint's state file."""
        self.policy.save_train_state(Path(path), key)

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

    streams = False  # each rank takes the whole batch at once: parts wait for `finish_update`

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
        gpus: float = 0.0,
    ) -> None:
        self.name, self.engine, self.weight_sync, self.servers = name, engine, weight_sync, servers
        self.lora = spec.lora is not None
        self._adapter_config: dict[str, Any] | None = None  # a LoRA policy's, once asked
        self.ranks = [TrainerRank.options(num_cpus=cpus, num_gpus=gpus).remote(rank, ranks) for rank in range(ranks)]
        master = ray.get(self.ranks[0].master_address.remote())
        ray.get([r.setup.remote(spec, name, model_path, init_path, master) for r in self.ranks])
        self._parts: list[Trajectory] = []  # the parts of the batch `finish_update` trains

    async def update(self, trajectories: list[Trajectory], generator: torch.Generator) -> dict[str, float]:
        batch = ray.put(trajectories)  # one copy in the object store, read by every rank
        state, version = generator.get_state(), self.engine.get_version()  # version: for the mismatch metrics
        results = await asyncio.gather(*(r.update.remote(batch, state, version) for r in self.ranks))
        stats, state = results[0]
        generator.set_state(state)
        return stats

    async def update_part(self, trajectories: list[Trajectory]) -> None:
        """Part of a batch, kept until `finish_update` (the ranks take a batch only whole)."""
        self._parts.extend(trajectories)

    async def finish_update(self, generator: torch.Generator) -> dict[str, float]:
        """One `update` of the parts fed so far."""
        parts, self._parts = self._parts, []
        return await self.update(parts, generator)

    async def push_weights(self) -> None:
        """Rank 0 writes the new weights; the servers load them (pause, swap, version + 1, resume)."""
        await self.weight_sync.push(self)

    async def tensors(self) -> dict[str, torch.Tensor]:
        """The full current weights, gathered by the ranks, copied to this process (a `WeightSource`); a LoRA
        policy's adapter alone."""
        if self.lora:
            return (await asyncio.gather(*(r.adapter_state.remote() for r in self.ranks)))[0][0]
        return (await asyncio.gather(*(r.state_dict.remote() for r in self.ranks)))[0]

    def adapter_config(self) -> dict[str, Any] | None:
        """A LoRA policy's ``adapter_config.json`` content (None: full weights); it never changes, so it is
        asked of the ranks once."""
        if self.lora and self._adapter_config is None:
            self._adapter_config = self._adapter_state()[1]
        return self._adapter_config

    def _adapter_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        return ray.get([r.adapter_state.remote() for r in self.ranks])[0]

    async def save_weights(self, path: Path, dtype: str | None = None) -> None:
        """The ranks gather the weights, rank 0 writes them under ``path`` (in ``dtype``; a `WeightSource`)."""
        await asyncio.gather(*(r.write_weights.remote(str(path), dtype) for r in self.ranks))

    async def wait_idle(self) -> None:
        """Nothing to wait for: an update is one call, awaited by the recipe."""

    def save_checkpoint(self, path: Path) -> None:
        """The ranks gather the weights and rank 0 writes them under ``path`` (`Policy.save_checkpoint`): the
        driver never holds a copy of the model. ``path`` must be on a filesystem rank 0 shares (as `DiskSync`'s)."""
        ray.get([r.save_checkpoint.remote(str(path)) for r in self.ranks])

    def save_train_state(self, path: Path, key: str | None = None) -> None:
        """The ranks gather the train state and rank 0 adds it to the checkpoint's state file at ``path``."""
        ray.get([r.save_train_state.remote(str(path), key) for r in self.ranks])

    def state_dict(self) -> dict[str, Any]:
        """The full train state, gathered by every rank (single-process layout: any world size resumes it)."""
        return ray.get([r.train_state.remote() for r in self.ranks])[0]

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

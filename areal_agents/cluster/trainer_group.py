"""An FSDP2 trainer as a group of Ray actors (a torch.distributed group: gloo on CPU, NCCL when each rank
reserves a GPU, ``ray.trainer_gpus`` > 0), and `RayTransport`, which carries a `RemotePolicy`'s calls to them.

Each rank is set up as a local rank process is (`load_trainable` with its `DataParallel`: the models
sharded per layer, `fsdp.py`) and answers as a `TrainerEndpoint`; it receives the whole batch, and
`ppo_update` gives each rank a token-balanced, padded share of the micro-batches and sums gradients, so all
ranks take the single-process trainer's step. Full weights and train state are gathered by all ranks; rank 0
writes the weights the model servers load and the checkpoints' model and train state. NCCL between Ray actors
has not run here (no GPUs): CI runs gloo.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import ray
import torch

from areal_agents.models.device import resolve_device
from areal_agents.models.loading import quiet_transformers
from areal_agents.net import free_port
from areal_agents.timeline import timeline_from_env
from areal_agents.trainers.distributed import DataParallel
from areal_agents.trainers.policy import load_trainable
from areal_agents.trainers.policy_api import TrainSpec
from areal_agents.trainers.run_start import seed_everything
from areal_agents.trainers.trainer_endpoint import TrainerEndpoint


@ray.remote
class TrainerRank:
    """One rank of the trainer: its `TrainerEndpoint` once `setup` has loaded its shards."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.endpoint: TrainerEndpoint | None = None
        self.dp: DataParallel | None = None

    def master_address(self) -> str:
        """``host:port`` for the process group (asked of rank 0)."""
        host = ray.util.get_node_ip_address()
        return f"{host}:{free_port(host)}"

    def setup(self, spec: TrainSpec, name: str, model_path: str, init_path: str, master: str) -> None:
        """Join the group (NCCL on the GPU Ray gave this actor, else gloo) and load this rank's shards."""
        quiet_transformers()
        timeline_from_env(f"trainer-{name}-rank{self.rank}")  # its updates' busy time, in the run's timeline
        device = resolve_device(spec.ppo.device, local_rank=0)  # Ray shows an actor only its own GPUs
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        self.dp = DataParallel.init(self.rank, self.world_size, master, backend)
        self.dp.device = device
        seed_everything(spec.seed)
        self.endpoint = TrainerEndpoint(load_trainable(name, spec, model_path, init_path, self.dp))

    def call(self, method: str, *args: Any) -> Any:
        """The endpoint's ``method(*args)`` (Ray resolves arguments put in the object store)."""
        return self.endpoint.call(method, args)

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        if self.dp is not None:
            self.dp.close()


class RayTransport:
    """A `TrainerTransport` to ``ranks`` `TrainerRank` actors; ranks take a batch only whole.

    Example::

        transport = RayTransport.launch(spec, "policy", path, path, ranks=2)
        policy = RemotePolicy("policy", spec, serving, transport)
    """

    streams = False

    def __init__(self, ranks: list[Any]) -> None:
        self.ranks = ranks

    @classmethod
    def launch(
        cls,
        spec: TrainSpec,
        name: str,
        model_path: str,
        init_path: str,
        ranks: int = 1,
        cpus: float = 1.0,
        gpus: float = 0.0,
    ) -> RayTransport:
        """Start ``ranks`` actors (``cpus``, ``gpus`` each) and load each one's shards; all are killed if one fails."""
        transport = cls([TrainerRank.options(num_cpus=cpus, num_gpus=gpus).remote(r, ranks) for r in range(ranks)])
        try:
            master = ray.get(transport.ranks[0].master_address.remote())
            ray.get([r.setup.remote(spec, name, model_path, init_path, master) for r in transport.ranks])
        except BaseException:
            transport.close()
            raise
        return transport

    def _send(self, method: str, args: tuple) -> list[Any]:
        """``method`` on every rank; large arguments (a batch, a train state) go to the object store once."""
        refs = [ray.put(a) if isinstance(a, (list, dict)) else a for a in args]
        return [r.call.remote(method, *refs) for r in self.ranks]

    def call(self, method: str, *args: Any) -> Any:
        return ray.get(self._send(method, args))[0]

    async def acall(self, method: str, *args: Any) -> Any:
        return (await asyncio.gather(*self._send(method, args)))[0]

    async def weights(self) -> dict[str, torch.Tensor]:
        """The full weights, gathered by the ranks and copied to this process (a LoRA policy's adapter alone)."""
        return await self.acall("weights")

    async def wait_idle(self) -> None:
        """Nothing to wait for: each call is awaited by its caller."""

    def close(self) -> None:
        """Stop the rank actors (again: nothing)."""
        for rank in self.ranks:
            try:
                ray.get(rank.close.remote(), timeout=30)
            except (ray.exceptions.RayError, TimeoutError):
                pass
            ray.kill(rank)
        self.ranks = []

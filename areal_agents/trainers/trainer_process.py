"""`ProcessPolicy`: a policy whose PPO updates run in a child process of their own (``ppo.trainer: process``).

A local run's rollouts (event loop, agents, envs, the in-process engine's decode thread) and its updates
are both Python-heavy; in one process they take turns at one GIL, so overlapping them (max_staleness > 0)
gains little on a small machine. A spawned trainer process has its own interpreter: batches go to it over
a pipe, new weights come back through one shared-memory copy of the state dict, allocated once.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (registers the shared-memory pickling of the weights)
from transformers import PreTrainedModel

from areal_agents.engines.base import InferenceEngine
from areal_agents.engines.weight_sync import WeightSync, write_weights
from areal_agents.errors import ArealAgentsError
from areal_agents.models.loading import load_model, quiet_transformers
from areal_agents.trainers.policy import load_trainable
from areal_agents.trainers.policy_api import TrainSpec
from areal_agents.trainers.run_start import seed_everything
from areal_agents.types import Trajectory
from areal_agents.workers import start_child, stop_child

_START_TIMEOUT_S = 600.0


class TrainerProcessError(ArealAgentsError):
    """The trainer process raised (its traceback is in the message) or died."""


def _serve(conn: Any, spec: TrainSpec, name: str, model_path: str, init_path: str) -> None:
    """The child: load the trainable policy, then answer calls until ``close`` (or the pipe closes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it closes this process
    if spec.cpu_threads:
        torch.set_num_threads(spec.cpu_threads)
    quiet_transformers()
    seed_everything(spec.seed)
    try:
        policy = load_trainable(name, spec, model_path, init_path)
        weights = {k: v.detach().clone().share_memory_() for k, v in policy.model.state_dict().items()}
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", weights))

    @torch.no_grad()
    def publish() -> None:
        """The current weights into the shared copy (the parent reads it only until its next call)."""
        for key, value in policy.model.state_dict().items():
            weights[key].copy_(value)

    calls = {
        "update": policy.remote_train_step,
        "update_part": policy.train_part,
        "finish_update": policy.remote_finish_step,
        "publish": publish,
        "state_dict": policy.state_dict,
        "load_state_dict": policy.load_state_dict,
    }
    while True:
        try:
            method, args = conn.recv()
        except EOFError:  # the parent went away
            return
        if method == "close":
            return
        try:
            conn.send(("ok", calls[method](*args)))
        except BaseException:
            conn.send(("error", traceback.format_exc()))


class ProcessPolicy:
    """A `TrainablePolicy` with the trainer in a spawned process (``spec.cpu_threads`` intra-op threads)
    and generation on ``engine`` in this one; ``weight_sync`` moves the shared-memory weights to it.

    Example::

        policy = ProcessPolicy("policy", spec, model_path, model_path, engine, InProcessSync([engine]))
        stats = await policy.update(trajectories, generator)
    """

    streams = True

    def __init__(
        self,
        name: str,
        spec: TrainSpec,
        model_path: str,
        init_path: str,
        engine: InferenceEngine,
        weight_sync: WeightSync,
        servers: Any = None,
    ) -> None:
        self.name, self.engine, self.weight_sync, self.servers = name, engine, weight_sync, servers
        self.model_path, self.dtype = model_path, spec.dtype
        self._process, self._conn, self._weights = start_child(
            _serve,
            (spec, name, model_path, init_path),
            f"trainer-{name}",
            TrainerProcessError,
            f"trainer process {name!r} failed in start",
            _START_TIMEOUT_S,
        )
        self._caller = ThreadPoolExecutor(1, f"trainer-{name}-pipe")  # waits on the pipe, off the event loop
        self._lock = threading.Lock()
        self._model: PreTrainedModel | None = None

    def _receive(self, method: str) -> Any:
        try:
            status, value = self._conn.recv()
        except (EOFError, ConnectionError):
            self._process.join(5)
            raise TrainerProcessError(
                f"trainer process {self.name!r} died during {method} (exit code {self._process.exitcode})"
            ) from None
        if status == "error":
            raise TrainerProcessError(f"trainer process {self.name!r} failed in {method}:\n{value}")
        return value

    def _call(self, method: str, *args: Any) -> Any:
        with self._lock:  # one call on the pipe at a time (the event loop's and a checkpoint's)
            try:
                self._conn.send((method, args))
            except (BrokenPipeError, ConnectionError, OSError):
                raise TrainerProcessError(
                    f"trainer process {self.name!r} is gone (exit code {self._process.exitcode}); cannot {method}"
                ) from None
            return self._receive(method)

    async def _acall(self, method: str, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._caller, self._call, method, *args)

    async def update(self, trajectories: list[Trajectory], generator: torch.Generator) -> dict[str, float]:
        stats, state = await self._acall("update", trajectories, generator.get_state())
        generator.set_state(state)
        return stats

    async def update_part(self, trajectories: list[Trajectory]) -> None:
        """Forward and backward on part of a batch in the trainer process (`Policy.update_part`)."""
        await self._acall("update_part", trajectories)

    async def finish_update(self, generator: torch.Generator) -> dict[str, float]:
        stats, state = await self._acall("finish_update", generator.get_state())
        generator.set_state(state)
        return stats

    async def wait_idle(self) -> None:
        """Return when the call on the pipe, if any, has been answered."""
        await asyncio.get_running_loop().run_in_executor(self._caller, int)

    async def push_weights(self) -> None:
        """The trainer's weights into shared memory, then to the engine (pause, swap, version + 1, resume)."""
        await self.weight_sync.push(self)

    async def tensors(self) -> dict[str, torch.Tensor]:
        """The trainer's current weights, in the shared-memory copy (a `WeightSource`)."""
        await self._acall("publish")
        return self._weights

    async def save_weights(self, path: Path) -> None:
        """The trainer's current weights as ``path/model.safetensors`` (a `WeightSource`)."""
        await asyncio.to_thread(write_weights, await self.tensors(), path)

    @property
    def model(self) -> PreTrainedModel:
        """A copy of the trainer's current weights in this process (for checkpoints)."""
        self._call("publish")
        if self._model is None:
            self._model = load_model(self.model_path, self.dtype)
        self._model.load_state_dict(self._weights)
        return self._model

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call("load_state_dict", state)

    def close(self) -> None:
        """Stop the trainer process (it exits on ``close``; a stuck one is killed) and the engine's servers."""
        stop_child(self._process, self._conn, ("close", ()))
        self._caller.shutdown()
        if self.servers is not None:
            self.servers.stop()

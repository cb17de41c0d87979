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

from areal_agents.config import TrainConfig
from areal_agents.engines.base import InferenceEngine
from areal_agents.errors import ArealAgentsError
from areal_agents.models.loading import load_model, quiet_transformers
from areal_agents.trainers.policy import load_trainable, open_policy_engine, trainer_threads
from areal_agents.trainers.run_start import seed_everything
from areal_agents.types import Trajectory
from areal_agents.workers import start_child, stop_child

_START_TIMEOUT_S = 600.0


class TrainerProcessError(ArealAgentsError):
    """The trainer process raised (its traceback is in the message) or died."""


def _serve(conn: Any, cfg: TrainConfig, name: str, model_path: str, init_path: str, threads: int) -> None:
    """The child: load the trainable policy, then answer calls until ``close`` (or the pipe closes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it closes this process
    torch.set_num_threads(threads)
    quiet_transformers()
    seed_everything(cfg.seed)
    try:
        policy = load_trainable(name, cfg, model_path, init_path)
        weights = {k: v.detach().clone().share_memory_() for k, v in policy.model.state_dict().items()}
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", weights))

    def update(trajectories: list[Trajectory], pad: int, generator_state: torch.Tensor) -> tuple[dict, Any]:
        return policy.remote_train_step(trajectories, cfg, pad, generator_state)

    @torch.no_grad()
    def publish() -> None:
        """The current weights into the shared copy (the parent reads it only until its next call)."""
        for key, value in policy.model.state_dict().items():
            weights[key].copy_(value)

    def update_part(trajectories: list[Trajectory], pad: int) -> None:
        policy.train_part(trajectories, cfg, pad)

    def finish_update(pad: int, generator_state: torch.Tensor) -> tuple[dict, Any]:
        return policy.remote_finish_step(cfg, pad, generator_state)

    calls = {
        "update": update,
        "update_part": update_part,
        "finish_update": finish_update,
        "publish": publish,
        "train_state": policy.train_state,
        "load_train_state": policy.load_train_state,
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
    """What the RL recipe needs of a policy (`update`, or `update_part` and `finish_update`; `push_weights`,
    `model`, train state), with the trainer in a spawned process and generation on ``engine`` in this one."""

    def __init__(
        self,
        name: str,
        cfg: TrainConfig,
        model_path: str,
        init_path: str,
        engine: InferenceEngine,
        servers: Any,
        threads: int,
    ) -> None:
        self.name, self.engine, self.servers = name, engine, servers
        self.model_path, self.dtype = model_path, cfg.model.dtype
        self._process, self._conn, self._weights = start_child(
            _serve,
            (cfg, name, model_path, init_path, threads),
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

    async def update(
        self, trajectories: list[Trajectory], cfg: TrainConfig, pad_token_id: int, generator: torch.Generator
    ) -> dict[str, float]:
        stats, state = await self._acall("update", trajectories, pad_token_id, generator.get_state())
        generator.set_state(state)
        return stats

    async def update_part(self, trajectories: list[Trajectory], cfg: TrainConfig, pad_token_id: int) -> None:
        """Forward and backward on part of a batch in the trainer process (`Policy.update_part`)."""
        await self._acall("update_part", trajectories, pad_token_id)

    async def finish_update(self, cfg: TrainConfig, pad_token_id: int, generator: torch.Generator) -> dict[str, float]:
        stats, state = await self._acall("finish_update", pad_token_id, generator.get_state())
        generator.set_state(state)
        return stats

    async def push_weights(self) -> None:
        """The trainer's weights into shared memory, then into the engine (pause, swap, version + 1, resume)."""
        await self._acall("publish")
        await self.engine.update_weights(self._weights)

    @property
    def model(self) -> PreTrainedModel:
        """A copy of the trainer's current weights in this process (for checkpoints)."""
        self._call("publish")
        if self._model is None:
            self._model = load_model(self.model_path, self.dtype)
        self._model.load_state_dict(self._weights)
        return self._model

    def train_state(self) -> dict[str, Any]:
        return self._call("train_state")

    def load_train_state(self, state: dict[str, Any]) -> None:
        self._call("load_train_state", state)

    def close(self) -> None:
        """Stop the trainer process (it exits on ``close``; a stuck one is killed)."""
        stop_child(self._process, self._conn, ("close", ()))
        self._caller.shutdown()


def open_process_policy(name: str, cfg: TrainConfig, model_path: str, init_path: str, run_dir: Path) -> ProcessPolicy:
    """`open_policy` with the trainer in its own process (``ppo.cpu_threads`` intra-op threads, or all
    cores less the local hf engine's when rollouts overlap updates)."""
    engine, servers = open_policy_engine(name, cfg, model_path, run_dir)
    try:
        return ProcessPolicy(
            name, cfg, model_path, init_path, engine, servers, cfg.ppo.cpu_threads or trainer_threads(cfg)
        )
    except BaseException:
        if hasattr(engine, "close"):  # an engine process of its own
            engine.close()
        if servers is not None:
            servers.stop()
        raise

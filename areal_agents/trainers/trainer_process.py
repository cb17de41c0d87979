"""`ProcessPolicy`: a policy whose PPO updates run in child processes of their own (``ppo.trainer: process``,
or ``ppo.nproc_per_node`` > 1: one FSDP2 rank per process).

A local run's rollouts (event loop, agents, envs, the in-process engine's decode thread) and its updates
are both Python-heavy; in one process they take turns at one GIL, so overlapping them (max_staleness > 0)
gains little on a small machine. A spawned trainer process has its own interpreter: batches go to it over
a pipe, new weights come back through one shared-memory copy of the state dict, allocated once. With N
ranks the driver keeps the rollout controller and the engine (the trainer stays off the rollout loop's
GIL, as with one process) and spawns N rank processes with torchrun's environment (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so a rank runs what torchrun would run:
gloo on CPU, NCCL on CUDA, rank r on the r-th visible GPU not set aside for servers (``engine.gpus``).
Every call goes to every rank (each takes its share; collectives need all); rank 0 answers and
publishes the gathered weights into the shared copy.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (registers the shared-memory pickling of the weights)

from areal_agents.config.placement import team_threads
from areal_agents.engines.base import InferenceEngine
from areal_agents.engines.weight_sync import WeightSync
from areal_agents.errors import ArealAgentsError
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
from areal_agents.workers import first_answer, spawn_child, start_child, stop_child

_START_TIMEOUT_S = 600.0


class TrainerProcessError(ArealAgentsError):
    """The trainer process raised (its traceback is in the message) or died."""


def _serve(
    conn: Any, spec: TrainSpec, name: str, model_path: str, init_path: str, env: dict[str, str] | None = None
) -> None:
    """The child: load the trainable policy (with ``env``, torchrun's, as one FSDP2 rank), then answer
    calls until ``close`` (or the pipe closes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it closes this process
    torch.set_num_threads(spec.cpu_threads or team_threads())  # 0: auto (a launcher fills in the run's)
    quiet_transformers()
    seed_everything(spec.seed)
    try:
        dp = None
        if env is not None:
            os.environ.update(env)
            dp = DataParallel.from_env(resolve_device(spec.ppo.device))
        policy = load_trainable(name, spec, model_path, init_path, dp)
        full = policy.weights()  # every rank gathers; rank 0 holds the shared copy
        weights = {k: v.detach().to("cpu", copy=True).share_memory_() for k, v in full.items()} or None
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", weights))

    @torch.no_grad()
    def publish() -> None:
        """The current weights into the shared copy (the parent reads it only until its next call)."""
        for key, value in policy.weights().items():
            weights[key].copy_(value)

    calls = {
        "update": policy.remote_train_step,
        "update_part": policy.train_part,
        "finish_update": policy.remote_finish_step,
        "publish": publish,
        "state_dict": policy.state_dict,
        "load_state_dict": policy.load_state_dict,
        "adapter_config": policy.adapter_config,
        "save_checkpoint": policy.save_checkpoint,
        "save_train_state": policy.save_train_state,
    }
    try:
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
    finally:
        if dp is not None:
            dp.close()


def rank_environments(nproc: int, engine_gpus: list[int]) -> list[dict[str, str]]:
    """torchrun's environment for each of ``nproc`` ranks on this machine; with GPUs, those visible less
    ``engine_gpus`` (indices among the visible ones), rank r using the r-th of them (its ``LOCAL_RANK``)."""
    port = free_port("127.0.0.1")
    common = {"WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1"}
    common["MASTER_PORT"] = str(port)
    if torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(torch.cuda.device_count())]
        common["CUDA_VISIBLE_DEVICES"] = ",".join(g for i, g in enumerate(ids) if i not in engine_gpus)
    return [common | {"RANK": str(r), "LOCAL_RANK": str(r)} for r in range(nproc)]


class ProcessPolicy:
    """A `TrainablePolicy` with the trainer in ``nproc`` spawned processes (one, or FSDP2 ranks; ``spec.cpu_threads``
    intra-op threads in all) and generation on ``engine`` in this one; ``weight_sync`` moves the
    shared-memory weights to it. ``engine_gpus``: GPUs the ranks leave to the servers.

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
        nproc: int = 1,
        engine_gpus: list[int] | None = None,
    ) -> None:
        self.name, self.engine, self.weight_sync, self.servers = name, engine, weight_sync, servers
        self.lora = spec.lora is not None
        self._adapter_config: dict[str, Any] | None = None  # a LoRA policy's, once asked
        if nproc == 1:
            process, conn, self._weights = start_child(
                _serve,
                (spec, name, model_path, init_path),
                f"trainer-{name}",
                TrainerProcessError,
                f"trainer process {name!r} failed in start",
                _START_TIMEOUT_S,
            )
            self._processes, self._conns = [process], [conn]
        else:
            self.streams = False  # each rank takes the whole batch at once
            spec = replace(spec, cpu_threads=max(1, (spec.cpu_threads or team_threads()) // nproc))  # one team each
            envs = rank_environments(nproc, engine_gpus or [])
            self._processes, self._conns, self._weights = _start_ranks(spec, name, model_path, init_path, envs)
        self._process, self._conn = self._processes[0], self._conns[0]  # rank 0: it answers
        self._caller = ThreadPoolExecutor(1, f"trainer-{name}-pipe")  # waits on the pipe, off the event loop
        self._lock = threading.Lock()
        self._parts: list[Trajectory] = []  # with ranks: the parts of the batch `finish_update` trains

    def _who(self, rank: int) -> str:
        return f"trainer process {self.name!r}" + (f" (rank {rank})" if len(self._processes) > 1 else "")

    def _receive(self, method: str, rank: int = 0) -> Any:
        process = self._processes[rank]
        try:
            status, value = self._conns[rank].recv()
        except (EOFError, ConnectionError):
            process.join(5)
            raise TrainerProcessError(
                f"{self._who(rank)} died during {method} (exit code {process.exitcode})"
            ) from None
        if status == "error":
            raise TrainerProcessError(f"{self._who(rank)} failed in {method}:\n{value}")
        return value

    def _call(self, method: str, *args: Any) -> Any:
        """``method`` on every rank (one call on the pipes at a time: the event loop's and a checkpoint's);
        rank 0's answer, or the first rank's error once all have answered."""
        with self._lock:
            for rank, conn in enumerate(self._conns):
                try:
                    conn.send((method, args))
                except (BrokenPipeError, ConnectionError, OSError):
                    raise TrainerProcessError(
                        f"{self._who(rank)} is gone (exit code {self._processes[rank].exitcode}); cannot {method}"
                    ) from None
            answers, error = [], None
            for rank in range(len(self._conns)):
                try:
                    answers.append(self._receive(method, rank))
                except TrainerProcessError as e:
                    error = error or e
            if error is not None:
                raise error
            return answers[0]

    async def _acall(self, method: str, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._caller, self._call, method, *args)

    async def update(self, trajectories: list[Trajectory], generator: torch.Generator) -> dict[str, float]:
        version = self.engine.get_version()  # the mismatch metrics' tokens (`Policy.version`)
        stats, state = await self._acall("update", trajectories, generator.get_state(), None, version)
        generator.set_state(state)
        return stats

    async def update_part(self, trajectories: list[Trajectory]) -> None:
        """Forward and backward on part of a batch in the trainer process (`Policy.update_part`); with ranks,
        which take a batch only whole, the part waits for `finish_update`."""
        if not self.streams:
            self._parts.extend(trajectories)
            return
        await self._acall("update_part", trajectories, self.engine.get_version())

    async def finish_update(self, generator: torch.Generator) -> dict[str, float]:
        """The step of the parts fed so far (with ranks: one `update` of them all)."""
        if not self.streams:
            parts, self._parts = self._parts, []
            return await self.update(parts, generator)
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

    async def save_weights(self, path: Path, dtype: str | None = None) -> None:
        """The trainer's current weights under ``path`` by `write_weights` (in ``dtype``; a `WeightSource`); a
        LoRA policy's adapter as PEFT's directory."""
        if self.lora:
            await asyncio.to_thread(write_adapter, path, await self.tensors(), self.adapter_config())
            return
        await asyncio.to_thread(write_weights, await self.tensors(), path, dtype)

    def adapter_config(self) -> dict[str, Any] | None:
        """A LoRA policy's ``adapter_config.json`` content (None: full weights); it never changes, so it is
        asked of the trainer once."""
        if self.lora and self._adapter_config is None:
            self._adapter_config = self._call("adapter_config")
        return self._adapter_config

    def save_checkpoint(self, path: Path) -> None:
        """The trainer process writes its weights under ``path`` (`Policy.save_checkpoint`; with ranks, each
        gathers and rank 0 writes): this process never holds a copy of the model."""
        self._call("save_checkpoint", path)

    def save_train_state(self, path: Path, key: str | None = None) -> None:
        """The trainer process adds its train state to the checkpoint's state file (`Policy.save_train_state`;
        with ranks, each gathers and rank 0 writes): the optimizer state never comes to this process."""
        self._call("save_train_state", path, key)

    def state_dict(self) -> dict[str, Any]:
        return self._call("state_dict")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._call("load_state_dict", state)

    def close(self) -> None:
        """Stop the trainer processes (each exits on ``close``; a stuck one is killed) and the engine's servers."""
        for conn in self._conns:  # all told first: a rank leaving its process group waits for the others
            try:
                conn.send(("close", ()))
            except (BrokenPipeError, ConnectionError, OSError):
                pass
        for process, conn in zip(self._processes, self._conns):
            stop_child(process, conn, ("close", ()))
        self._caller.shutdown()
        if self.servers is not None:
            self.servers.stop()


def _start_ranks(
    spec: TrainSpec, name: str, model_path: str, init_path: str, envs: list[dict[str, str]]
) -> tuple[list[Any], list[Any], dict[str, torch.Tensor]]:
    """Spawn one `_serve` per environment, all before waiting (each joins the process group in its start);
    their processes, pipes and rank 0's shared weights. `TrainerProcessError` if any fails: all are stopped."""
    started = [
        spawn_child(_serve, (spec, name, model_path, init_path, env), f"trainer-{name}-{env['RANK']}") for env in envs
    ]
    processes, conns = [p for p, _ in started], [c for _, c in started]
    answers, failure = [], None
    for rank, (process, conn) in enumerate(started):
        status, value = first_answer(process, conn, _START_TIMEOUT_S)
        if status == "error":
            failure = f"trainer rank {rank} of {name!r} failed in start:\n{value}"
            break
        answers.append(value)
    if failure is not None:
        for process, conn in zip(processes, conns):
            stop_child(process, conn, None, timeout=0)
        raise TrainerProcessError(failure)
    return processes, conns, answers[0]

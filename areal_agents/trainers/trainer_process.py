"""`PipeTransport`: a `RemotePolicy`'s trainer in child processes of its own (``ppo.trainer: process``, or
``ppo.nproc_per_node`` > 1: one FSDP2 rank per process), reached over pipes.

A local run's rollouts (event loop, agents, envs, the in-process engine's decode thread) and its updates
are both Python-heavy; in one process they take turns at one GIL, so overlapping them (max_staleness > 0)
gains little on a small machine. A spawned trainer process has its own interpreter: batches go to it over
a pipe, new weights come back through one shared-memory copy of the state dict, allocated once. With N
ranks the driver keeps the rollout controller and the engine (the trainer stays off the rollout loop's
GIL, as with one process) and spawns N rank processes with torchrun's environment (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so a rank runs what torchrun would run:
gloo on CPU, NCCL on CUDA, rank r on the r-th visible GPU not set aside for servers (``engine.gpus``).
Every call goes to every rank's `TrainerEndpoint`; rank 0 answers and publishes the gathered weights into
the shared copy. `PipeTransport.start` spawns any endpoint the same way (serve-tinker's ranks).
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from multiprocessing.connection import wait as connection_wait
from typing import Any

import torch
import torch.multiprocessing  # noqa: F401  (registers the shared-memory pickling of the weights)

from areal_agents.config.placement import team_threads
from areal_agents.errors import ArealAgentsError
from areal_agents.models.device import resolve_device
from areal_agents.models.loading import quiet_transformers
from areal_agents.net import free_port
from areal_agents.timeline import timeline_from_env
from areal_agents.trainers.distributed import DataParallel
from areal_agents.trainers.policy import load_trainable
from areal_agents.trainers.policy_api import TrainSpec
from areal_agents.trainers.run_start import seed_everything
from areal_agents.trainers.trainer_endpoint import TrainerEndpoint
from areal_agents.workers import first_answer, spawn_child, start_child, stop_child

_START_TIMEOUT_S = 600.0
# after a rank's error, how long the others may take to answer: past it they are waiting in a collective for
# the rank that failed (a rank's share of a call runs collectives every layer, so seconds apart)
STUCK_AFTER_ERROR_S = 120.0


class TrainerProcessError(ArealAgentsError):
    """The trainer process raised (its traceback is in the message) or died."""


@dataclass(frozen=True)
class RankOptions:
    """How each spawned endpoint process runs: intra-op ``threads`` (0: auto), torch's ``seed``, the
    ``device`` of its rank (``auto``/``cpu``/``cuda``) and a ``label`` for its timeline."""

    threads: int = 0
    seed: int = 0
    device: str = "cpu"
    label: str = "trainer"


def _serve(conn: Any, build: Callable[..., tuple[Any, Any]], args: tuple, how: RankOptions, env: dict | None) -> None:
    """The child: ``build(dp, *args)`` (with ``env``, torchrun's, as one rank of a process group: ``dp``; else
    None) gives an endpoint and its first answer; then the endpoint answers ``(method, args)`` calls on the
    pipe (``endpoint.call``) until ``close`` (or the pipe closes)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it closes this process
    torch.set_num_threads(how.threads or team_threads())  # 0: auto (a launcher fills in the run's)
    quiet_transformers()
    seed_everything(how.seed)
    timeline_from_env(how.label + (f"-rank{env['RANK']}" if env else ""))  # the run's timeline
    try:
        dp = None
        if env is not None:
            os.environ.update(env)
            dp = DataParallel.from_env(resolve_device(how.device))
        endpoint, first = build(dp, *args)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", first))
    try:
        while True:
            try:
                method, call_args = conn.recv()
            except EOFError:  # the parent went away
                return
            if method == "close":
                return
            try:
                conn.send(("ok", endpoint.call(method, call_args)))
            except BaseException:
                conn.send(("error", traceback.format_exc()))
    finally:
        if dp is not None:
            dp.close()


def policy_endpoint(
    dp: DataParallel | None, spec: TrainSpec, name: str, model_path: str, init_path: str
) -> tuple[TrainerEndpoint, dict[str, torch.Tensor] | None]:
    """A rank's `TrainerEndpoint` over its policy (`load_trainable`), and rank 0's shared-memory copy of the
    weights (every rank gathers them; rank 0 holds the copy)."""
    policy = load_trainable(name, spec, model_path, init_path, dp)
    full = policy.weights()
    shared = {k: v.detach().to("cpu", copy=True).share_memory_() for k, v in full.items()}
    return TrainerEndpoint(policy, shared), shared or None


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


class PipeTransport:
    """A `TrainerTransport` to a trainer in ``nproc`` spawned processes (one, or FSDP2 ranks; ``spec.cpu_threads``
    intra-op threads in all). ``engine_gpus``: GPUs the ranks leave to the servers.

    Example::

        transport = PipeTransport.spawn(spec, "policy", model_path, model_path)
        policy = RemotePolicy("policy", spec, Serving(engine, InProcessSync([engine]), None), transport)
    """

    def __init__(
        self, name: str, processes: list[Any], conns: list[Any], shared: dict[str, torch.Tensor] | None
    ) -> None:
        self.name, self.processes, self._conns, self._shared = name, processes, conns, shared
        self.streams = len(processes) == 1  # ranks take a batch only whole
        self._caller = ThreadPoolExecutor(1, f"trainer-{name}-pipe")  # waits on the pipe, off the event loop
        self._lock = threading.Lock()
        self.stuck_after_s = STUCK_AFTER_ERROR_S

    @classmethod
    def spawn(
        cls,
        spec: TrainSpec,
        name: str,
        model_path: str,
        init_path: str,
        nproc: int = 1,
        engine_gpus: list[int] | None = None,
    ) -> PipeTransport:
        """Start the trainer's processes, each loading its policy (`load_trainable`); `TrainerProcessError` if
        one fails (all are stopped)."""
        threads = spec.cpu_threads or team_threads()
        if nproc > 1:
            spec = replace(spec, cpu_threads=max(1, threads // nproc))  # one team each
        how = RankOptions(spec.cpu_threads, spec.seed, spec.ppo.device, f"trainer-{name}")
        return cls.start(name, policy_endpoint, (spec, name, model_path, init_path), how, nproc, engine_gpus)

    @classmethod
    def start(
        cls,
        name: str,
        build: Callable[..., tuple[Any, Any]],
        args: tuple,
        how: RankOptions,
        nproc: int = 1,
        engine_gpus: list[int] | None = None,
    ) -> PipeTransport:
        """``nproc`` processes (one, or the ranks of a process group), each answering calls with the endpoint
        ``build(dp, *args)`` gives it (module-level: the processes are spawned); `TrainerProcessError` if one
        fails to start (all are stopped). Its shared weights: rank 0's first answer."""
        if nproc == 1:
            process, conn, shared = start_child(
                _serve,
                (build, args, how, None),
                f"trainer-{name}",
                TrainerProcessError,
                f"trainer process {name!r} failed in start",
                _START_TIMEOUT_S,
            )
            return cls(name, [process], [conn], shared)
        how = replace(how, threads=max(1, (how.threads or team_threads()) // nproc))
        envs = rank_environments(nproc, engine_gpus or [])
        return cls(name, *_start_ranks(name, build, args, how, envs))

    def _who(self, rank: int) -> str:
        return f"trainer process {self.name!r}" + (f" (rank {rank})" if len(self.processes) > 1 else "")

    def _receive(self, method: str, rank: int = 0) -> Any:
        process = self.processes[rank]
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

    def call(self, method: str, *args: Any) -> Any:
        """``method`` on every rank (one call on the pipes at a time: the event loop's and a checkpoint's);
        rank 0's answer, or the first rank's error once all have answered. Ranks meet in collectives, so one
        that dies leaves the others waiting for good: the trainer is stopped, every rank, and the error says
        which died; one that fails while the others do not answer within `stuck_after_s` stops it too."""
        with self._lock:
            for rank, conn in enumerate(self._conns):
                try:
                    conn.send((method, args))
                except (BrokenPipeError, ConnectionError, OSError):
                    exitcode = self.processes[rank].exitcode
                    self._stop_ranks()  # those that took the call would wait for this one in a collective
                    raise TrainerProcessError(
                        f"{self._who(rank)} is gone (exit code {exitcode}); cannot {method}"
                    ) from None
            answers, error = self._answers(method)
            if error is not None:
                raise error
            return answers[0]

    def _answers(self, method: str) -> tuple[dict[int, Any], TrainerProcessError | None]:
        """Every rank's answer to ``method`` as it comes (a rank that died: at once, by its process sentinel),
        and the first error; the ranks stopped when one died or the rest hang after an error."""
        pending = {conn: rank for rank, conn in enumerate(self._conns)}
        answers: dict[int, Any] = {}
        error, deadline = None, None
        while pending:
            sentinels = {self.processes[rank].sentinel: conn for conn, rank in pending.items()}
            wait_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = connection_wait([*pending, *sentinels], wait_s)
            if not ready:  # a rank failed and the others never answered: waiting in a collective for it
                self._stop_ranks()
                stuck = ", ".join(str(rank) for rank in sorted(pending.values()))
                return answers, TrainerProcessError(
                    f"{error}\nranks {stuck} of trainer {self.name!r} did not answer within {self.stuck_after_s:.0f}s "
                    "after it (waiting in a collective for it): the trainer is stopped"
                )
            for conn in {sentinels.get(obj, obj) for obj in ready}:
                rank = pending.pop(conn)
                try:
                    answers[rank] = self._receive(method, rank)
                except TrainerProcessError as e:
                    if not self.processes[rank].is_alive() and len(self.processes) > 1:
                        self._stop_ranks()  # a dead rank: no collective completes again
                        return answers, e
                    error = error or e
                    deadline = deadline or time.monotonic() + self.stuck_after_s
        return answers, error

    def _stop_ranks(self) -> None:
        """Kill every trainer process (a broken process group): later calls find them gone."""
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(5)

    async def acall(self, method: str, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._caller, self.call, method, *args)

    async def weights(self) -> dict[str, torch.Tensor]:
        """The trainer's weights, published into the shared-memory copy."""
        await self.acall("publish")
        return self._shared

    async def wait_idle(self) -> None:
        """Return when the call on the pipe, if any, has been answered."""
        await asyncio.get_running_loop().run_in_executor(self._caller, int)

    def close(self) -> None:
        """Stop the trainer processes (each exits on ``close``; a stuck one is killed)."""
        for conn in self._conns:  # all told first: a rank leaving its process group waits for the others
            try:
                conn.send(("close", ()))
            except (BrokenPipeError, ConnectionError, OSError):
                pass
        for process, conn in zip(self.processes, self._conns):
            stop_child(process, conn, ("close", ()))
        self._caller.shutdown()


def _start_ranks(
    name: str, build: Callable[..., tuple[Any, Any]], args: tuple, how: RankOptions, envs: list[dict[str, str]]
) -> tuple[list[Any], list[Any], Any]:
    """Spawn one `_serve` per environment, all before waiting (each joins the process group in its start);
    their processes, pipes and rank 0's first answer. `TrainerProcessError` if any fails: all are stopped."""
    started = [spawn_child(_serve, (build, args, how, env), f"trainer-{name}-{env['RANK']}") for env in envs]
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

"""Env-step servers as Ray actors: each replica hosts the ordinary env-step server (``envs/runtime/server.py``)
on its node; a `RemoteEnvPool` spreads sessions over them and re-resolves addresses after a restart."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
import uuid
from collections.abc import Sequence

import ray
import uvicorn

from areal_agents.config import EnvConfig
from areal_agents.data.sources import datasets_in
from areal_agents.envs.registry import import_env_module, modules_for
from areal_agents.envs.runtime.remote import RemoteEnvPool
from areal_agents.envs.runtime.server import ServerConfig, build_app, dedicated_server
from areal_agents.errors import ClusterError
from areal_agents.net import free_port
from areal_agents.timeline import timeline_from_env


@ray.remote
class EnvServerActor:
    """One env-step server, served by uvicorn on a thread of this actor; a restart starts a new one."""

    def __init__(self, cfg: EnvConfig, datasets: Sequence[str] = ()) -> None:
        host = ray.util.get_node_ip_address()
        port = free_port(host)
        modules = modules_for(cfg.id, cfg.module)  # a server imports no module a client names: the run's, at start
        allowed = datasets_in(cfg.kwargs) + list(datasets)  # nor loads a dataset the run did not name
        server_cfg = ServerConfig(
            host, port, cfg.mode, cfg.workers, cfg.step_timeout, modules=modules, datasets=allowed
        )
        timeline_from_env("env-server-actor")  # its env workers' busy time, in the run's timeline
        self.env_server = dedicated_server(server_cfg)
        app = build_app(self.env_server)
        gc.collect()
        gc.freeze()  # as serve-env: no collection walks the modules' objects again (a third of a step's CPU)
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.address = f"http://{host}:{port}"
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"env server on {self.address} did not start")
            time.sleep(0.02)

    def url(self) -> str:
        return self.address

    def steps(self) -> int:
        """Env steps served since this actor (re)started."""
        return self.env_server.metrics.counters["steps"]

    def pid(self) -> int:
        return os.getpid()


class EnvServers:
    """The replicas of a run: start them, know their current addresses, make pools over them."""

    def __init__(
        self, names: list[str], urls: list[str], timeout_s: float, unreachable_timeout_s: float = 30.0
    ) -> None:
        # rollout workers get a copy: names, not handles, so it pickles small (Ray restarts need that)
        self.names, self.urls, self.timeout_s = names, urls, timeout_s
        self.unreachable_timeout_s = unreachable_timeout_s  # env.unreachable_timeout_s
        self._actors: list | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_actors": None}

    @property
    def actors(self) -> list:
        if self._actors is None:
            self._actors = [ray.get_actor(name) for name in self.names]
        return self._actors

    @classmethod
    def launch(
        cls,
        cfg: EnvConfig,
        replicas: int,
        num_cpus: float,
        max_restarts: int,
        timeout_s: float,
        datasets: Sequence[str] = (),
    ):
        """``datasets``: what the servers may load besides those ``cfg.kwargs`` names (the eval kwargs')."""
        for module in modules_for(cfg.id, cfg.module):
            import_env_module(module)  # a module that fails to import is one line here, not an actor's traceback
        names = [f"areal-env-server-{uuid.uuid4().hex[:8]}-{i}" for i in range(replicas)]
        options = {"num_cpus": num_cpus, "max_restarts": max_restarts}
        actors = [EnvServerActor.options(name=name, **options).remote(cfg, list(datasets)) for name in names]
        urls = ray.get([a.url.remote() for a in actors], timeout=timeout_s)
        servers = cls(names, urls, timeout_s, cfg.unreachable_timeout_s)
        servers._actors = actors
        return servers

    async def resolve(self) -> list[str]:
        """Addresses of the replicas that answer, waiting up to the timeout for those restarting."""
        alive = [url for url in await asyncio.gather(*(self._url(a) for a in self.actors)) if url]
        if not alive:
            raise ClusterError(
                f"no env server answered within {self.timeout_s:.0f}s (ray.recovery_timeout_s); "
                f"{len(self.actors)} replicas, ray.max_restarts exhausted or the nodes are gone"
            )
        self.urls = alive
        return alive

    async def _url(self, actor) -> str | None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            try:
                return await asyncio.wait_for(actor.url.remote(), 5)
            except ray.exceptions.ActorDiedError:
                return None  # restarts exhausted
            except (TimeoutError, ray.exceptions.RayActorError):
                await asyncio.sleep(0.5)  # restarting
        return None

    def steps(self) -> list[int]:
        """Env steps per replica (-1: not answering)."""
        out = []
        for actor in self.actors:
            try:
                out.append(ray.get(actor.steps.remote(), timeout=10))
            except (ray.exceptions.RayError, TimeoutError):
                out.append(-1)
        return out

    def pool(self) -> RemoteEnvPool:
        return RemoteEnvPool(self.urls, resolve=self.resolve, unreachable_timeout_s=self.unreachable_timeout_s)

    def kill(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)

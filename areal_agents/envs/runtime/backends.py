"""Open the env backend a config names: a `LocalEnvPool`, or a `RemoteEnvPool` (launching a server)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from areal_agents.config import EnvConfig
from areal_agents.data.sources import datasets_in
from areal_agents.envs.async_env import AsyncEnv
from areal_agents.envs.registry import import_env_module, modules_for
from areal_agents.envs.runtime.pool import LocalEnvPool
from areal_agents.envs.runtime.remote import EnvServerProcess, RemoteEnvPool


@dataclass
class EnvBackend:
    """``make(**overrides)`` gives a new async env of the configured id; ``aclose`` stops everything."""

    cfg: EnvConfig
    pool: LocalEnvPool | RemoteEnvPool
    server: EnvServerProcess | None = None

    def make(self, **kwarg_overrides: Any) -> AsyncEnv:
        return self.pool.make(self.cfg.id, **{**self.cfg.kwargs, **kwarg_overrides})

    async def check(self, **kwarg_overrides: Any) -> None:
        """Reset and close one env now, so a bad id, kwargs or server fail at start-up, not per episode."""
        env = self.make(**kwarg_overrides)
        await env.areset(seed=0)
        await env.aclose()

    async def aclose(self) -> None:
        await self.pool.aclose()
        if self.server is not None:
            self.server.stop()


def open_env_backend(cfg: EnvConfig, datasets: Sequence[str] = (), owner: str | None = None) -> EnvBackend:
    """A launched server may load the datasets ``cfg.kwargs`` names and ``datasets`` (e.g. the eval kwargs');
    ``owner`` tags the sessions of a remote pool (`RemoteEnvPool`)."""
    if cfg.backend == "local":
        import_env_module(cfg.module)
        return EnvBackend(cfg, LocalEnvPool(cfg.mode, cfg.workers, cfg.step_timeout, [cfg.module]))
    if cfg.server_url:
        return EnvBackend(
            cfg, RemoteEnvPool(cfg.server_url, unreachable_timeout_s=cfg.unreachable_timeout_s, owner=owner)
        )
    modules = modules_for(cfg.id, cfg.module)
    allowed = datasets_in(cfg.kwargs) + list(datasets)
    server = EnvServerProcess(
        mode=cfg.mode, workers=cfg.workers, step_timeout=cfg.step_timeout, module=modules, dataset=allowed
    )
    pool = RemoteEnvPool(server.url, unreachable_timeout_s=cfg.unreachable_timeout_s, owner=owner)
    return EnvBackend(cfg, pool, server)

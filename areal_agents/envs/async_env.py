"""The async env interface that agents and the rollout controller see.

`LocalAsyncEnv` wraps a sync gymnasium env in-process; the env-step server's `RemoteEnv` (a later
module) implements the same three methods over HTTP.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Executor
from typing import Any, Protocol

import gymnasium as gym


class AsyncEnv(Protocol):
    async def areset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]: ...

    async def astep(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]: ...

    async def aclose(self) -> None: ...


class LocalAsyncEnv:
    """Run a sync env's methods inline (cheap envs) or in ``executor`` (CPU-heavy envs)."""

    def __init__(self, env: gym.Env, executor: Executor | None = None) -> None:
        self.env = env
        self.executor = executor

    async def _call(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        if self.executor is None:
            return fn(*args, **kwargs)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor, lambda: fn(*args, **kwargs))

    async def areset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]:
        return await self._call(self.env.reset, seed=seed, options=options)

    async def astep(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        return await self._call(self.env.step, action)

    async def aclose(self) -> None:
        await self._call(self.env.close)

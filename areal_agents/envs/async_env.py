"""The async env interface that agents and the rollout controller see.

`LocalEnvPool` (in-process: inline, threads or worker processes) and `RemoteEnvPool` (the env-step
server over HTTP) both make envs with these three methods.
"""

from __future__ import annotations

from typing import Any, Protocol


class AsyncEnv(Protocol):
    async def areset(self, seed: int | None = None, options: dict | None = None) -> tuple[str, dict]: ...

    async def astep(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]: ...

    async def aclose(self) -> None: ...

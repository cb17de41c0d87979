"""The async env interface that agents and the rollout controller see.

`LocalEnvPool` (in-process: inline, threads or worker processes) and `RemoteEnvPool` (the env-step
server over HTTP) both make envs with these three methods and the ``acting`` attribute.
"""

from __future__ import annotations

from typing import Any, Protocol


class AsyncEnv(Protocol):
    """A single-agent env takes a text action and returns ``(observation, reward, terminated, truncated,
    info)``; a multi-agent env (`MultiAgentTextEnv`) takes a dict of one action per acting agent and returns
    the five dicts keyed by agent id.

    ``acting``: for a multi-agent env, who acts next after each ``areset``/``astep`` (its
    ``acting_agents()``; [] once the episode is over), so an agent generates for exactly those; None for a
    single-agent env."""

    acting: list[str] | None

    async def areset(self, seed: int | None = None, options: dict | None = None) -> tuple[Any, dict]: ...

    async def astep(self, action: Any) -> tuple[Any, Any, Any, Any, Any]: ...

    async def aclose(self) -> None: ...

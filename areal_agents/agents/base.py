"""The `Agent` protocol: play one episode against an async env and return its trajectories."""

from __future__ import annotations

from typing import Protocol

from areal_agents.envs.async_env import AsyncEnv
from areal_agents.types import Trajectory


class Agent(Protocol):
    """One async method, as in AReaL's workflow API. Returns one trajectory per segment (usually one).
    ``aclose`` ends what an agent holds at the end of a run; a class that derives from `Agent` inherits its
    default (nothing to close), and `make_agent` gives it to a configured class that does not."""

    async def run_episode(self, env: AsyncEnv, *, seed: int | None, episode_id: str) -> list[Trajectory]: ...

    async def aclose(self) -> None:
        """Stop what the agent started (a proxy, a client); nothing by default."""

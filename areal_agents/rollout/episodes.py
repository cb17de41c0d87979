"""Run groups of episodes concurrently and keep an exact ledger of what happened to each.

A group is ``group_size`` episodes of one prompt: every env of the group is reset with the same seed,
so they see the same problem (a GRPO group).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

from areal_agents.agents.base import Agent
from areal_agents.envs.async_env import AsyncEnv
from areal_agents.errors import EnvError
from areal_agents.types import Trajectory

log = logging.getLogger(__name__)


@dataclass
class RolloutLedger:
    """Every submitted episode ends accepted, rejected (its group was filtered out), failed (the agent or
    policy raised), env_failed, engine_failed, worker_failed (its rollout worker died every try) or
    cancelled; until then it is running. Nothing is lost."""

    submitted: int = 0
    accepted: int = 0
    rejected: int = 0
    failed: int = 0
    env_failed: int = 0
    engine_failed: int = 0
    worker_failed: int = 0
    cancelled: int = 0  # still running when the run ended (or the cluster failed under it)

    @property
    def running(self) -> int:
        ended = self.accepted + self.rejected + self.failed + self.env_failed + self.engine_failed
        return self.submitted - ended - self.worker_failed - self.cancelled


async def run_groups(
    agent: Agent,
    make_env: Callable[[], AsyncEnv],
    seeds: list[int],
    group_size: int,
    *,
    max_concurrent: int = 256,
    ledger: RolloutLedger | None = None,
    tag: str = "",
) -> list[list[Trajectory]]:
    """Run ``group_size`` episodes for each seed; return the trajectories of each group.

    An episode that raises is logged and counted (``env_failed`` for `EnvError`, else ``failed``); its
    group keeps the episodes that finished.
    """
    ledger = ledger if ledger is not None else RolloutLedger()
    gate = asyncio.Semaphore(max_concurrent)

    async def one(seed: int, group_id: str, k: int) -> list[Trajectory]:
        async with gate:
            ledger.submitted += 1
            episode_id = f"{group_id}/e{k}"
            try:
                trajectories = await agent.run_episode(make_env(), seed=seed, episode_id=episode_id)
            except EnvError as e:  # the env's fault, not the policy's
                ledger.env_failed += 1
                log.warning("episode %s: env failure %s", episode_id, e)
                return []
            except Exception:
                ledger.failed += 1
                log.exception("episode %s failed", episode_id)
                return []
            ledger.accepted += 1
            for t in trajectories:
                t.group_id = group_id
            return trajectories

    tasks = [[asyncio.ensure_future(one(seed, f"{tag}g{seed}", k)) for k in range(group_size)] for seed in seeds]
    groups = []
    for group_tasks in tasks:
        results = await asyncio.gather(*group_tasks)
        groups.append([t for episode in results for t in episode])
    return groups

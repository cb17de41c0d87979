"""Greedy evaluation on a fixed set of env seeds: the held-out accuracy printed by `train` and `sft`."""

from __future__ import annotations

from collections.abc import Callable

import gymnasium as gym

from areal_agents.agents.base import Agent
from areal_agents.envs.async_env import AsyncEnv, LocalAsyncEnv
from areal_agents.errors import ArealAgentsError
from areal_agents.rollout.episodes import run_groups


def distinct_seeds(make_env: Callable[[], gym.Env], n: int, start: int = 0) -> list[int]:
    """The first ``n`` seeds from ``start`` whose first observations are all different.

    So an evaluation set of n seeds is n distinct problems, fixed across runs and machines.
    """
    env = make_env()
    seen: set[str] = set()
    seeds: list[int] = []
    seed = start
    while len(seeds) < n:
        if seed - start > 100 * n:
            raise ArealAgentsError(f"the env yields only {len(seeds)} distinct problems; asked for {n}")
        observation, _ = env.reset(seed=seed)
        if observation not in seen:
            seen.add(observation)
            seeds.append(seed)
        seed += 1
    env.close()
    return seeds


async def evaluate(
    agent: Agent, make_env: Callable[[], gym.Env], seeds: list[int], max_concurrent: int = 256
) -> dict[str, float]:
    """One episode per seed; ``accuracy`` is the fraction of episodes with total reward >= 1."""

    def make_async() -> AsyncEnv:
        return LocalAsyncEnv(make_env())

    groups = await run_groups(agent, make_async, seeds, 1, max_concurrent=max_concurrent, tag="eval")
    rewards = [g[0].reward if g else 0.0 for g in groups]
    turns = [g[0].metadata["num_turns"] for g in groups if g]
    return {
        "accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
        "reward_mean": sum(rewards) / len(rewards),
        "turns_mean": sum(turns) / max(len(turns), 1),
        "episodes": float(len(rewards)),
    }

"""Greedy evaluation on a fixed set of env seeds: the held-out accuracy printed by `train` and `sft`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from areal_agents.agents.base import Agent
from areal_agents.envs.async_env import AsyncEnv
from areal_agents.errors import ArealAgentsError
from areal_agents.rollout.episodes import run_groups


async def distinct_seeds(make_env: Callable[[], AsyncEnv], n: int, start: int = 0, chunk: int = 64) -> list[int]:
    """The first ``n`` seeds from ``start`` whose first observations are all different.

    So an evaluation set of n seeds is n distinct problems, fixed across runs and machines.
    """

    async def first_observation(seed: int) -> str:
        env = make_env()
        observation, _ = await env.areset(seed=seed)
        await env.aclose()
        return observation

    seen: set[str] = set()
    seeds: list[int] = []
    seed = start
    while len(seeds) < n:
        if seed - start > 100 * n:
            raise ArealAgentsError(f"the env yields only {len(seeds)} distinct problems; asked for {n}")
        batch = list(range(seed, seed + chunk))
        for s, observation in zip(batch, await asyncio.gather(*(first_observation(s) for s in batch))):
            if observation not in seen and len(seeds) < n:
                seen.add(observation)
                seeds.append(s)
        seed += chunk
    return seeds


async def evaluate(
    agent: Agent, make_env: Callable[[], AsyncEnv], seeds: list[int], max_concurrent: int = 256
) -> dict[str, float]:
    """One episode per seed; ``accuracy`` is the fraction of episodes with total reward >= 1."""
    groups = await run_groups(agent, make_env, seeds, 1, max_concurrent=max_concurrent, tag="eval")
    rewards = [g[0].reward if g else 0.0 for g in groups]
    turns = [g[0].metadata["num_turns"] for g in groups if g]
    return {
        "accuracy": sum(r >= 1.0 for r in rewards) / len(rewards),
        "reward_mean": sum(rewards) / len(rewards),
        "turns_mean": sum(turns) / max(len(turns), 1),
        "episodes": float(len(rewards)),
    }

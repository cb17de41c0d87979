"""Greedy evaluation on a fixed set of env seeds: the held-out accuracy printed by `train` and `sft`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from areal_agents.agents.base import Agent
from areal_agents.envs.async_env import AsyncEnv
from areal_agents.errors import ArealAgentsError, RunHalted
from areal_agents.models.loading import warn_prompts_over_context
from areal_agents.progress import plural
from areal_agents.rollout.episodes import RolloutLedger, run_groups
from areal_agents.rollout.failures import FailureLog
from areal_agents.types import Trajectory


async def distinct_seeds(
    make_env: Callable[[], AsyncEnv], n: int, start: int = 0, chunk: int = 64, key: str = "eval.num_problems"
) -> list[int]:
    """The first ``n`` seeds from ``start`` whose first observations are all different.

    So an evaluation set of n seeds is n distinct problems, fixed across runs and machines.

    Raises:
        ArealAgentsError: the env yields fewer than ``n`` distinct problems in its first ``100 * n``
            seeds; the message names the config key that asked for ``n`` (``key``).
    """

    async def first_observation(seed: int) -> str:
        env = make_env()
        observation, _ = await env.areset(seed=seed)
        await env.aclose()
        return repr(sorted(observation.items())) if isinstance(observation, dict) else observation  # multi-agent

    seen: set[str] = set()
    seeds: list[int] = []
    seed = start
    while len(seeds) < n:
        if seed - start > 100 * n:
            raise ArealAgentsError(
                f"{key}={n}, but the env yields only {plural(len(seeds), 'distinct problem')} (in seeds {start} "
                f"to {seed - 1}): set {key}={len(seeds)} or fewer, or evaluate on an env or split with more "
                "problems (eval.env_kwargs)"
            )
        batch = list(range(seed, seed + chunk))
        for s, observation in zip(batch, await asyncio.gather(*(first_observation(s) for s in batch))):
            if observation not in seen and len(seeds) < n:
                seen.add(observation)
                seeds.append(s)
        seed += chunk
    return seeds


async def evaluate(
    agent: Agent,
    make_env: Callable[[], AsyncEnv],
    seeds: list[int],
    max_concurrent: int = 256,
    n_samples: int = 1,
    *,
    ledger: RolloutLedger | None = None,
    max_retries: int = 0,
    failures: FailureLog | None = None,
    dump: Callable[[list[Trajectory]], None] | None = None,
) -> dict[str, float]:
    """``n_samples`` episodes per seed; ``accuracy`` is the fraction of successful episodes (avg@n): the
    env's ``info["success"]`` when it reports one (a debate's majority answer), else total reward >= 1;
    with n > 1 also ``pass@n``. With several agents, ``accuracy/AGENT`` is each agent's own. The episodes
    run through `run_groups` (one `EpisodeRunner`, ``max_retries``), counted in ``ledger`` when given; a
    failed episode counts as unsuccessful (``episodes_failed`` counts them), and when none completed this
    raises `RunHalted` rather than report an accuracy of 0. ``dump`` gets every trajectory (to write the samples)."""
    failures = failures if failures is not None else FailureLog()
    ledger = ledger if ledger is not None else RolloutLedger()
    mark, failed_before, accepted_before = failures.totals.copy(), ledger.failures, ledger.accepted
    groups = await run_groups(
        agent, make_env, seeds, n_samples, max_concurrent=max_concurrent, ledger=ledger, tag="eval",
        max_retries=max_retries, failures=failures,
    )  # fmt: skip
    if dump is not None:
        dump([t for g in groups for t in g])
    episodes: list[list[Trajectory | None]] = []  # per seed: the first trajectory of each episode
    for g in groups:
        firsts = [t for t in g if t.metadata.get("segment", 0) == 0 and t.agent_id == g[0].agent_id] if g else []
        episodes.append([*firsts, *[None] * (n_samples - len(firsts))])
    flat = [t for e in episodes for t in e]
    failed = ledger.failures - failed_before
    if failed and ledger.accepted == accepted_before:
        failures.flush()
        causes = failures.describe(failures.since(mark)) or "see the log"
        raise RunHalted(f"held-out eval: none of its {plural(len(flat), 'episode')} completed: {causes}")
    warn_prompts_over_context(0 if failed else sum(not any(e) for e in episodes), len(seeds), None, "held-out eval")
    per_seed = [[bool(t.metadata.get("success", t.reward >= 1.0)) if t else False for t in e] for e in episodes]
    success = [ok for s in per_seed for ok in s]
    rewards = [t.reward if t else 0.0 for t in flat]
    turns = [t.metadata["num_turns"] for t in flat if t]
    out = {
        "accuracy": sum(success) / len(success),
        "reward_mean": sum(rewards) / len(rewards),
        "turns_mean": sum(turns) / max(len(turns), 1),
        "episodes": float(len(rewards)),
        "episodes_failed": float(failed),
    }
    if n_samples > 1:
        out[f"pass@{n_samples}"] = sum(any(s) for s in per_seed) / len(per_seed)
    by_agent: dict[str, list[bool]] = {}
    for g in groups:
        for t in g:
            if t.metadata.get("segment", 0) == 0:
                by_agent.setdefault(t.agent_id, []).append(t.reward >= 1.0)
    if len(by_agent) > 1:
        out |= {f"accuracy/{a}": sum(v) / (len(seeds) * n_samples) for a, v in sorted(by_agent.items())}
    return out

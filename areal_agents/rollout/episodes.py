"""Run episodes and count each one: the one episode runner (`EpisodeRunner`) and groups of episodes.

Every caller that runs an episode (the `RolloutController`, `run_groups`, the held-out `evaluate`, the
``eval`` command, the Ray rollout workers) goes through `EpisodeRunner.run`, so an episode is tried,
retried and counted in a `RolloutLedger` the same way everywhere:

    runner = EpisodeRunner(RolloutLedger(), max_retries=1)
    trajectories = await runner.run(lambda: agent.run_episode(make_env(), seed=0, episode_id="e0"), "e0")

A group is ``group_size`` episodes of one prompt: every env of the group is reset with the same seed,
so they see the same problem (a GRPO group).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

from areal_agents.agents.base import Agent
from areal_agents.envs.async_env import AsyncEnv
from areal_agents.errors import ClusterError, EngineError, EnvError, RequestError, RunHalted, WorkerLostError
from areal_agents.rollout.failures import FailureLog
from areal_agents.timeline import in_episode, timeline
from areal_agents.types import Trajectory

log = logging.getLogger(__name__)

FailureKind = Literal["env", "engine", "worker", "cluster", "halt", "failed"]
OUTCOMES = {"env": "env_failed", "engine": "engine_failed", "worker": "worker_failed"}  # the ledger's names
Episode = Callable[[], Awaitable[list[Trajectory]]]  # one try of an episode: its trajectories, or it raises
EpisodeFn = Callable[[int, str], Awaitable[list[Trajectory]]]  # (seed, episode_id) -> one try of that episode


@dataclass
class RolloutLedger:
    """Every submitted episode ends accepted, rejected (its group was filtered out), failed (the agent or
    policy raised), env_failed, engine_failed, worker_failed (its rollout worker died every try) or
    cancelled (cut off, or ended well in a group the trainer never took); until then it is running. Nothing
    is lost:

        submitted = accepted + rejected + failed + env_failed + engine_failed + worker_failed + cancelled + running
    """

    submitted: int = 0
    accepted: int = 0
    rejected: int = 0
    failed: int = 0
    env_failed: int = 0
    engine_failed: int = 0
    worker_failed: int = 0
    cancelled: int = 0  # cut off (the run ended, the cluster failed), or its group was never trained

    @property
    def running(self) -> int:
        ended = self.accepted + self.rejected + self.failed + self.env_failed + self.engine_failed
        return self.submitted - ended - self.worker_failed - self.cancelled

    def counts(self) -> dict[str, int]:
        """Every count by name, ``running`` included (checkpoints, summaries, eval records)."""
        return {**dataclasses.asdict(self), "running": self.running}

    def reject(self, episodes: int) -> None:
        """Move ``episodes`` accepted episodes to rejected: their group was filtered out or went stale."""
        self.accepted -= episodes
        self.rejected += episodes

    def cancel(self, episodes: int) -> None:
        """Move ``episodes`` accepted episodes to cancelled: their group was never trained (the run ended, or
        a resume runs it again)."""
        self.accepted -= episodes
        self.cancelled += episodes

    def fail(self, kind: FailureKind) -> None:
        """Count an episode that ended with a failure of ``kind`` (a cluster failure cancels it; a halt, the
        run's own mistake, fails it)."""
        name = {**OUTCOMES, "cluster": "cancelled"}.get(kind, "failed")
        setattr(self, name, getattr(self, name) + 1)

    @property
    def ended(self) -> int:
        """Episodes that ended, well or not (not cancelled)."""
        return self.accepted + self.rejected + self.failures

    @property
    def failures(self) -> int:
        """Episodes that failed after their retries, every kind."""
        return self.failed + self.env_failed + self.engine_failed + self.worker_failed


def failure_kind(error: BaseException) -> FailureKind:
    """Whose fault ``error`` is: the env's, the engine's, a lost rollout worker's, the cluster's (the run
    cannot go on), the run's own (``halt``: e.g. an env server refused its request; it stops), or else the
    policy's or the agent's (``failed``)."""
    if isinstance(error, ClusterError):
        return "cluster"
    if isinstance(error, RunHalted):
        return "halt"
    if isinstance(error, EnvError):
        return "env"
    if isinstance(error, EngineError):
        return "engine"
    if isinstance(error, WorkerLostError):
        return "worker"
    return "failed"


class EpisodeRunner:
    """Run an episode, retry it when the env, the engine or its rollout worker failed (up to
    ``max_retries`` times, after a short pause), and count it in ``ledger``.

        runner = EpisodeRunner(ledger, max_retries=1)
        trajectories = await runner.run(lambda: agent.run_episode(env, seed=3, episode_id="g3/e0"), "g3/e0")

    A policy or agent failure is not retried; a refused request (`RequestError`) would be refused again,
    so it is not retried either. Failed episodes return None; each failure is reported to ``failures``
    (a `FailureLog`: rate-limited lines, one traceback per cause). A `RunHalted` (a `ClusterError`, an env
    server's 4xx, no env server left) and cancellation propagate: the run cannot go on. ``retries`` and
    ``worker_retries`` are the run's one count of tries run again (the controller's stats and summary.json's
    ``episode_retries`` read them).
    """

    def __init__(
        self,
        ledger: RolloutLedger | None = None,
        *,
        max_retries: int = 0,
        failures: FailureLog | None = None,
        retry_pause_s: float = 0.25,
    ) -> None:
        if max_retries < 0:
            raise ValueError(f"max_retries: expects a value >= 0, got {max_retries}")
        self.ledger = ledger if ledger is not None else RolloutLedger()
        self.max_retries = max_retries
        self.failures = failures if failures is not None else FailureLog()
        self.retry_pause_s = retry_pause_s  # doubled each try of an episode, up to 8x: a restarting server has time
        self.retries = 0  # tries run again, all kinds
        self.worker_retries = 0  # of which: the rollout worker died

    async def run(self, episode: Episode, episode_id: str) -> list[Trajectory] | None:
        """The trajectories of ``episode`` (called once per try), or None when it failed."""
        self.ledger.submitted += 1
        # what the episode's generate calls and env steps record names it
        with in_episode(episode_id), timeline().span("episodes", "episode", outcome="cancelled") as span:
            try:
                trajectories = await self._tries(episode, episode_id)
            except Exception:
                span["outcome"] = "halted"  # the run cannot go on (`RunHalted`, a cluster error)
                raise
            span["outcome"] = "accepted" if trajectories is not None else "failed"
            if trajectories:
                span["reward"] = {t.agent_id: t.reward for t in trajectories if t.metadata.get("segment", 0) == 0}
            return trajectories

    async def _tries(self, episode: Episode, episode_id: str) -> list[Trajectory] | None:
        attempt, kind = 0, "failed"
        while True:
            try:
                if attempt:  # a restarting server or engine gets a moment
                    await asyncio.sleep(self.retry_pause_s * 2 ** min(attempt - 1, 3))
                    self.retries += 1
                    self.worker_retries += kind == "worker"
                trajectories = await episode()
            except asyncio.CancelledError:
                self.ledger.cancelled += 1
                raise
            except Exception as e:  # noqa: BLE001  (classified, counted and reported below)
                kind = failure_kind(e)
                if kind in ("cluster", "halt"):
                    self.ledger.fail(kind)
                    raise
                if kind != "failed" and attempt < self.max_retries and not isinstance(e, RequestError):
                    attempt += 1
                    self.failures.record("retried", e, episode_id)
                    continue
                self.ledger.fail(kind)
                self.failures.record(OUTCOMES.get(kind, "failed"), e, episode_id)
                return None
            self.ledger.accepted += 1
            return trajectories


def local_episode(agent: Agent, make_env: Callable[[], AsyncEnv]) -> EpisodeFn:
    """``(seed, episode_id) -> trajectories``: one try of an episode of ``agent`` on a fresh env, in this process."""

    async def episode(seed: int, episode_id: str) -> list[Trajectory]:
        return await agent.run_episode(make_env(), seed=seed, episode_id=episode_id)

    return episode


async def run_groups(
    agent: Agent,
    make_env: Callable[[], AsyncEnv],
    seeds: list[int],
    group_size: int,
    *,
    max_concurrent: int = 256,
    ledger: RolloutLedger | None = None,
    tag: str = "",
    max_retries: int = 0,
    failures: FailureLog | None = None,
) -> list[list[Trajectory]]:
    """Run ``group_size`` episodes for each seed through one `EpisodeRunner`; return the trajectories of
    each group. A failed episode is reported to ``failures`` and counted in ``ledger``; its group keeps the
    episodes that finished."""
    runner = EpisodeRunner(ledger, max_retries=max_retries, failures=failures)
    episode = local_episode(agent, make_env)
    gate = asyncio.Semaphore(max_concurrent)

    async def one(seed: int, group_id: str, k: int) -> list[Trajectory]:
        episode_id = f"{group_id}/e{k}"
        async with gate:
            trajectories = await runner.run(lambda: episode(seed, episode_id), episode_id)
        for t in trajectories or []:
            t.group_id = group_id
        return trajectories or []

    tasks = [[asyncio.ensure_future(one(seed, f"{tag}g{seed}", k)) for k in range(group_size)] for seed in seeds]
    try:
        groups = []
        for group_tasks in tasks:
            results = await asyncio.gather(*group_tasks)
            groups.append([t for episode in results for t in episode])
        return groups
    except BaseException:  # a halt or a cancellation: the other episodes stop too, their outcomes read
        every = [task for group_tasks in tasks for task in group_tasks]
        for task in every:
            task.cancel()
        await asyncio.gather(*every, return_exceptions=True)
        raise

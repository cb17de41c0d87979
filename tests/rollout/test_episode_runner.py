"""The one episode runner: each failure kind retried or not, and every episode in exactly one ledger count."""

import asyncio
import dataclasses

import pytest

from areal_agents.engines.hf.request_checks import RequestError
from areal_agents.errors import ClusterError, EngineError, EnvError, WorkerLostError
from areal_agents.rollout.episodes import EpisodeRunner, RolloutLedger, failure_kind, run_groups
from areal_agents.types import Trajectory


def trajectory(episode_id="e"):
    return [Trajectory([1, 2], [0, 1], [0.0, -0.5], [-1, 0], reward=1.0, episode_id=episode_id)]


def failing(*errors):
    """An episode whose tries raise ``errors`` in turn, then succeed; ``tries`` counts the calls."""
    tries = []

    async def episode():
        tries.append(1)
        if len(tries) <= len(errors):
            raise errors[len(tries) - 1]
        return trajectory()

    return episode, tries


def balanced(ledger):
    ended = sum(v for k, v in dataclasses.asdict(ledger).items() if k != "submitted")
    return ledger.submitted == ended + ledger.running


@pytest.mark.parametrize(
    "error, kind",
    [
        (EnvError("timeout", "slow"), "env"),
        (EngineError("503"), "engine"),
        (RequestError("too long"), "engine"),
        (WorkerLostError("actor died"), "worker"),
        (ClusterError("no workers"), "cluster"),
        (RuntimeError("bug"), "failed"),
    ],
)
def test_failure_kinds(error, kind):
    assert failure_kind(error) == kind


@pytest.mark.parametrize("error", [EnvError("env_error", "x"), EngineError("x"), WorkerLostError("x")])
def test_an_infrastructure_failure_is_retried_and_the_episode_counted_once(error):
    runner = EpisodeRunner(max_retries=1)
    episode, tries = failing(error)
    assert asyncio.run(runner.run(episode, "e")) is not None
    assert len(tries) == 2 and runner.retries == 1 and runner.worker_retries == int(isinstance(error, WorkerLostError))
    assert runner.ledger == RolloutLedger(submitted=1, accepted=1)


@pytest.mark.parametrize(
    "error, counter",
    [
        (EnvError("env_error", "x"), "env_failed"),
        (EngineError("x"), "engine_failed"),
        (WorkerLostError("x"), "worker_failed"),
    ],
)
def test_retries_exhausted_count_the_failure_kind(error, counter):
    runner = EpisodeRunner(max_retries=2)
    episode, tries = failing(error, error, error)
    assert asyncio.run(runner.run(episode, "e")) is None
    assert len(tries) == 3 and getattr(runner.ledger, counter) == 1 and balanced(runner.ledger)


def test_policy_failures_and_refused_requests_are_not_retried():
    runner = EpisodeRunner(max_retries=3)
    bug, bug_tries = failing(RuntimeError("bug"))
    refused, refused_tries = failing(RequestError("prompt longer than the context"))
    assert asyncio.run(runner.run(bug, "a")) is None and asyncio.run(runner.run(refused, "b")) is None
    assert (len(bug_tries), len(refused_tries), runner.retries) == (1, 1, 0)
    assert runner.ledger == RolloutLedger(submitted=2, failed=1, engine_failed=1)


def test_a_cluster_failure_or_cancellation_counts_cancelled_and_propagates():
    runner = EpisodeRunner(max_retries=3)
    episode, _ = failing(ClusterError("gone"))
    with pytest.raises(ClusterError):
        asyncio.run(runner.run(episode, "a"))

    async def cancelled():
        task = asyncio.ensure_future(runner.run(lambda: asyncio.sleep(10), "b"))
        await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    asyncio.run(cancelled())
    assert runner.ledger == RolloutLedger(submitted=2, cancelled=2) and runner.ledger.running == 0


def test_the_runner_counts_each_retry_once_by_kind():
    runner = EpisodeRunner(max_retries=2)
    episode, _ = failing(EnvError("timeout", "x"), WorkerLostError("x"))
    asyncio.run(runner.run(episode, "e"))
    assert (runner.retries, runner.worker_retries) == (2, 1)  # an env retry, then a lost worker's


def test_a_rejected_group_moves_its_episodes_from_accepted_to_rejected():
    ledger = RolloutLedger(submitted=5, accepted=4, failed=1)
    ledger.reject(3)  # a group of 3 filtered out (or gone stale)
    assert ledger == RolloutLedger(submitted=5, accepted=1, rejected=3, failed=1) and balanced(ledger)


def test_max_retries_must_not_be_negative():
    with pytest.raises(ValueError, match="max_retries: expects a value >= 0, got -1"):
        EpisodeRunner(max_retries=-1)


class ScriptedAgent:
    """Episode k of each group: 0 succeeds, 1 fails in the env, 2 in the engine, 3 by the policy."""

    async def run_episode(self, env, *, seed, episode_id):
        k = int(episode_id.rsplit("/e", 1)[1])
        if k == 1:
            raise EnvError("env_error", "x")
        if k == 2:
            raise EngineError("x")
        if k == 3:
            raise RuntimeError("bug")
        return trajectory(episode_id)


def test_run_groups_counts_each_failure_kind_in_the_ledger():
    ledger = RolloutLedger()
    groups = asyncio.run(run_groups(ScriptedAgent(), lambda: None, [5, 6], 4, ledger=ledger))
    assert [[t.group_id for t in g] for g in groups] == [["g5"], ["g6"]]
    assert ledger == RolloutLedger(submitted=8, accepted=2, failed=2, env_failed=2, engine_failed=2)

"""The driver's dispatcher over rollout worker actors (a local Ray cluster, small stand-in actors): a
worker that dies loses nothing (its episodes run again on another), and when no worker comes back the
run stops with a clear `ClusterError` instead of waiting forever; the ledger balances either way."""

import asyncio
import os
import sys
from importlib.util import find_spec

import pytest

from areal_agents.errors import ClusterError, EngineError, EnvError
from areal_agents.rollout.controller import RolloutController
from areal_agents.types import Trajectory

pytestmark = [pytest.mark.process, pytest.mark.skipif(find_spec("ray") is None, reason="ray is not installed")]


@pytest.fixture(scope="module")
def worker_actor():
    """`Worker` as a Ray actor class, on a local cluster that lasts the module."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the actors cannot import this test module
    yield ray.remote(max_restarts=0)(Worker)
    ray.shutdown()


class Worker:
    """Answers episodes like a `RolloutWorker`; a ``dying`` one is killed (SIGKILL) by its first episode."""

    def __init__(self, dying: bool) -> None:
        self.dying = dying

    async def run_episode(self, seed: int, episode_id: str):
        if self.dying:
            os.kill(os.getpid(), 9)
        await asyncio.sleep(0.01)
        t = Trajectory([1, 2], [0, 1], [0.0, -1.0], [-1, 0], reward=float(seed % 2), episode_id=episode_id)
        return "ok", [t]

    async def run_episodes(self, episodes):
        return list(await asyncio.gather(*(self.run_episode(seed, eid) for seed, eid in episodes)))

    def pid(self) -> int:
        return os.getpid()


def controller(workers, batch_size=4):
    return RolloutController(
        None, None, lambda i: i, batch_size=batch_size, group_size=2, get_version=lambda: 0,
        max_retries=2, run_episode=workers.run_episode,
    )  # fmt: skip


def balanced(ledger) -> bool:
    ended = ledger.accepted + ledger.rejected + ledger.failed + ledger.env_failed + ledger.engine_failed
    return ledger.submitted == ended + ledger.worker_failed + ledger.cancelled + ledger.running


def test_a_dead_worker_s_episodes_run_again_on_the_other(worker_actor):
    from areal_agents.cluster.rollout_workers import RolloutWorkers

    workers = RolloutWorkers([worker_actor.remote(True), worker_actor.remote(False)], recovery_timeout_s=5)

    async def run():
        c = controller(workers)
        batch = await c.get_batch()
        await c.aclose()
        return c, batch

    c, batch = asyncio.run(run())
    assert len(batch) == 4 and all(len(g.trajectories) == 2 for g in batch)  # nothing lost
    assert workers.lost >= 1 and c.runner.worker_retries == workers.lost
    assert c.ledger.worker_failed == 0 and balanced(c.ledger)


def test_no_worker_coming_back_stops_the_run_with_the_reason(worker_actor):
    from areal_agents.cluster.rollout_workers import RolloutWorkers

    workers = RolloutWorkers([worker_actor.remote(True)], recovery_timeout_s=2)

    async def run():
        c = controller(workers)
        try:
            with pytest.raises(ClusterError, match="no rollout worker came back within 2s"):
                await asyncio.wait_for(c.get_batch(), 60)
        finally:
            await c.aclose()
        return c

    c = asyncio.run(run())
    assert c.ledger.accepted == 0 and balanced(c.ledger) and c.ledger.running == 0


@pytest.mark.parametrize(
    "error",
    [
        EnvError("timeout", "slow step"),
        EngineError("503"),
        ClusterError("gone"),
        RuntimeError("policy bug"),
    ],
)
def test_a_workers_failure_reaches_the_driver_as_the_same_kind(error):
    """What a worker reports (`failure_kind` and text) is raised again in the driver as an error of the
    same kind, so the controller's `EpisodeRunner` retries and counts it as if it ran there."""
    from areal_agents.cluster.rollout_workers import RolloutWorker, _rebuilt
    from areal_agents.rollout.episodes import failure_kind

    class Raising:
        async def run_episode(self, env, *, seed, episode_id):
            raise error

    worker = RolloutWorker.__ray_actor_class__.__new__(RolloutWorker.__ray_actor_class__)
    worker.episode = lambda seed, episode_id: Raising().run_episode(None, seed=seed, episode_id=episode_id)
    kind, value = asyncio.run(worker.run_episode(0, "g0/e0"))
    assert kind == failure_kind(error)
    assert failure_kind(_rebuilt(kind, value, "episode g0/e0 on worker 0")) == kind


def test_a_request_a_workers_engine_refused_is_refused_in_the_driver_too():
    """A refusal (a prompt past the context) is an engine failure that the driver must not retry: it comes
    back as a `RequestError`, which the `EpisodeRunner` counts at once."""
    from areal_agents.cluster.rollout_workers import RolloutWorker, _rebuilt
    from areal_agents.errors import RequestError
    from areal_agents.rollout.episodes import failure_kind

    class Refusing:
        async def run_episode(self, env, *, seed, episode_id):
            raise RequestError("input_ids: 5000 tokens do not fit the model's context of 512")

    worker = RolloutWorker.__ray_actor_class__.__new__(RolloutWorker.__ray_actor_class__)
    worker.episode = lambda seed, episode_id: Refusing().run_episode(None, seed=seed, episode_id=episode_id)
    kind, value = asyncio.run(worker.run_episode(0, "g0/e0"))
    error = _rebuilt(kind, value, "episode g0/e0 on worker 0")
    assert isinstance(error, RequestError) and failure_kind(error) == "engine" and "5000 tokens" in str(error)

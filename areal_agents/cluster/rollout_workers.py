"""Rollout workers as Ray actors, and the driver's dispatcher that runs the controller's episodes on them.

The staleness gate, the ledger and the retries stay in the driver's `RolloutController` (its
`EpisodeRunner`); each worker runs one try of each episode it is handed (agent + engine client + env
client), so the per-episode Python (chat templates, tokenizing, env traffic) spreads over the cluster.
A worker that dies fails its in-flight episodes with `WorkerLostError`, which the controller retries on
the others (Ray restarts the worker meanwhile); when no worker comes back within
``ray.recovery_timeout_s`` the run stops with a `ClusterError`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import traceback
from typing import Any

import ray

from areal_agents.agents.factory import make_rollout_agent
from areal_agents.cluster.env_servers import EnvServers
from areal_agents.config import TrainConfig
from areal_agents.engines.base import InferenceEngine
from areal_agents.engines.local_servers import engine_client
from areal_agents.engines.lora_sync import LoraGroup
from areal_agents.envs.runtime.backends import EnvBackend
from areal_agents.errors import ClusterError, EngineError, EnvError, RequestError, RunHalted, WorkerLostError
from areal_agents.models.loading import load_tokenizer, quiet_transformers
from areal_agents.rollout.episodes import failure_kind, local_episode
from areal_agents.timeline import in_episode, timeline_from_env
from areal_agents.trainers.policy_api import SHARED, policy_starts
from areal_agents.types import Trajectory

log = logging.getLogger(__name__)


@ray.remote
class RolloutWorker:
    """Runs episodes of the run's agent against the model servers and the env servers."""

    def __init__(
        self, cfg: TrainConfig, engine_urls: list[str], env_servers: EnvServers, admin_key: str | None = None
    ) -> None:
        quiet_transformers()
        self.engine = engine_client(cfg.engine, engine_urls, admin_key=admin_key)  # the servers' key
        timeline_from_env("rollout-worker")  # the run's timeline (after the client: the driver polls the servers)
        self.agent = make_rollout_agent(cfg.rollout, adapter_views(cfg, self.engine), load_tokenizer(cfg.model.path))
        self.envs = EnvBackend(cfg.env, env_servers.pool())
        self.episode = local_episode(self.agent, self.envs.make)

    async def run_episodes(self, episodes: list[tuple[int, str]]) -> list[tuple[str, Any]]:
        """Run ``(seed, episode_id)`` episodes concurrently; one `run_episode` result each, in order."""
        return list(await asyncio.gather(*(self.run_episode(seed, eid) for seed, eid in episodes)))

    async def run_episode(self, seed: int, episode_id: str) -> tuple[str, Any]:
        """``("ok", trajectories)``, or the failure's kind (`failure_kind`, as the driver's `EpisodeRunner`
        counts it) and text: exceptions do not cross processes cleanly, and the driver must tell an env
        failure from an engine failure from a policy one. One try: the driver retries."""
        try:
            with in_episode(episode_id):  # its generate calls and env steps name it in the timeline
                return "ok", await self.episode(seed, episode_id)
        except Exception as e:  # noqa: BLE001  (classified; the driver raises it again, counts and logs it)
            kind = failure_kind(e)
            if isinstance(e, EnvError):
                return kind, (e.kind, e.detail)
            if isinstance(e, RequestError):
                return "refused", str(e)  # an engine failure the driver must not retry
            return kind, traceback.format_exc() if kind == "failed" else str(e)

    def pid(self) -> int:
        return os.getpid()


def adapter_views(cfg: TrainConfig, engine: InferenceEngine) -> InferenceEngine | dict[str, InferenceEngine]:
    """What the worker's agent generates with: the engine; with LoRA policies, a view per policy that names
    its adapter on every request (one for the shared policy, else one per agent id, as the driver has)."""
    starts = policy_starts(cfg)
    if all(start.lora is None for start in starts.values()):
        return engine
    group = LoraGroup(engine)
    views = {name: group.view(name) for name in starts}
    return views[SHARED] if SHARED in views else views


class RolloutWorkers:
    """The driver's side: ``await workers.run_episode(seed, episode_id)`` on the least busy live worker.

    The episodes of one group, submitted together, travel in one actor call (a Ray call's CPU cost is
    paid once, not group_size times); the controller waits for the whole group anyway."""

    def __init__(self, actors: list, recovery_timeout_s: float) -> None:
        self.actors = actors
        self.recovery_timeout_s = recovery_timeout_s
        self.in_flight = [0] * len(actors)
        self.down: dict[int, asyncio.Task] = {}  # worker -> the task waiting for it to come back
        self.lost = 0  # episodes whose worker died under them
        self.episodes = [0] * len(actors)  # episodes each worker finished (ok or failed by the policy)
        self._pending: dict[str, list[tuple[int, str, asyncio.Future]]] = {}  # group -> episodes this tick

    @classmethod
    def launch(
        cls, cfg: TrainConfig, engine_urls: list[str], env_servers: EnvServers, admin_key: str | None = None
    ) -> RolloutWorkers:
        options = {"num_cpus": cfg.ray.rollout_worker_cpus, "max_restarts": cfg.ray.max_restarts}
        options["max_concurrency"] = max(1000, cfg.rollout.max_concurrent_rollouts)
        actors = [
            RolloutWorker.options(**options).remote(cfg, engine_urls, env_servers, admin_key)
            for _ in range(cfg.ray.rollout_workers)
        ]
        ray.get([a.pid.remote() for a in actors], timeout=cfg.engine.startup_timeout_s)  # built, or the reason
        return cls(actors, cfg.ray.recovery_timeout_s)

    async def run_episode(self, seed: int, episode_id: str) -> list[Trajectory]:
        group = episode_id.rsplit("/", 1)[0]
        future = asyncio.get_running_loop().create_future()
        pending = self._pending.setdefault(group, [])
        pending.append((seed, episode_id, future))
        if len(pending) == 1:  # the first of its group this tick: send after the others have joined
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self._send(group)))
        k, (kind, value) = await future
        if kind == "ok":
            return value
        raise _rebuilt(kind, value, f"episode {episode_id} failed on rollout worker {k}")

    async def _send(self, group: str) -> None:
        batch = self._pending.pop(group)
        futures = [f for *_, f in batch]
        try:
            k = await self._pick()
        except ClusterError as e:
            for f in futures:
                f.set_exception(e)
            return
        self.in_flight[k] += len(batch)
        try:
            results = await self.actors[k].run_episodes.remote([(seed, eid) for seed, eid, _ in batch])
        except ray.exceptions.RayActorError as e:
            self.lost += len(batch)
            self._mark_down(k)
            for f in futures:
                f.set_exception(WorkerLostError(f"rollout worker {k} died during group {group} ({type(e).__name__})"))
            return
        finally:
            self.in_flight[k] -= len(batch)
        self.episodes[k] += len(batch)
        for f, result in zip(futures, results):
            f.set_result((k, result))

    async def _pick(self) -> int:
        live = [k for k in range(len(self.actors)) if k not in self.down]
        if not live:
            log.warning(
                "all %d rollout workers are down; waiting up to %.0fs (ray.recovery_timeout_s) for Ray to restart them",
                len(self.actors), self.recovery_timeout_s,
            )  # fmt: skip
            tasks = list(self.down.values())
            while not any(t.done() and t.result() for t in tasks):
                waiting = [t for t in tasks if not t.done()]
                if not waiting:
                    raise ClusterError(
                        f"no rollout worker came back within {self.recovery_timeout_s:.0f}s "
                        f"(ray.max_restarts exhausted, or their nodes are gone)"
                    )
                await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            live = [k for k in range(len(self.actors)) if k not in self.down]
        return min(live, key=lambda k: self.in_flight[k])

    def _mark_down(self, k: int) -> None:
        if k not in self.down:
            self.down[k] = asyncio.ensure_future(self._wait_back(k))

    async def _wait_back(self, k: int) -> bool:
        """Ping worker ``k`` until it answers (restarted) or the timeout; True if it is back."""
        deadline = asyncio.get_running_loop().time() + self.recovery_timeout_s
        while asyncio.get_running_loop().time() < deadline:
            try:
                await asyncio.wait_for(self.actors[k].pid.remote(), timeout=5)
            except ray.exceptions.ActorDiedError:
                break  # dead for good (restarts exhausted)
            except (TimeoutError, ray.exceptions.RayActorError):
                await asyncio.sleep(0.5)
                continue
            log.warning("rollout worker %d is back", k)
            del self.down[k]
            return True
        log.error("rollout worker %d did not come back within %.0fs", k, self.recovery_timeout_s)
        return False

    def kill(self) -> None:
        for task in self.down.values():
            task.cancel()
        for actor in self.actors:
            ray.kill(actor, no_restart=True)


def _rebuilt(kind: str, value: Any, where: str) -> Exception:
    """The exception a worker's ``(kind, value)`` stands for, so the driver's `EpisodeRunner` classifies it
    as the worker did (`failure_kind`)."""
    if kind == "env":
        return EnvError(*value)
    if kind == "engine":
        return EngineError(value)
    if kind == "refused":
        return RequestError(value)
    if kind == "worker":
        return WorkerLostError(f"{where}: {value}")
    if kind == "cluster":
        return ClusterError(value)
    if kind == "halt":
        return RunHalted(value)
    return RuntimeError(f"{where}:\n{value}")

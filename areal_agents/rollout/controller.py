"""`RolloutController`: episodes keep running while the trainer trains, within a staleness bound.

A producer task submits groups (``group_size`` episodes of one prompt) whenever the capacity gate allows

    capacity = min(max_concurrent - running, (max_staleness + version + 1) * batch_size - (accepted + running))

counted in groups, where ``version`` is the engine's policy version (one per weight update). With
``max_staleness = 0`` exactly one batch is produced per version: synchronous RL. With ``k > 0`` the
producer runs up to ``k`` batches ahead, so no sample is more than ``k`` versions older than the policy
it trains. Finished groups queue up for `get_batch` (or `stream_batch`, a group at a time); a group
filter (e.g. zero reward variance, for dynamic sampling) rejects groups, which then do not count
toward the batch.

Every episode runs through one `EpisodeRunner` (rollout/episodes.py) and is accounted for in the
`RolloutLedger`: submitted = accepted + rejected + failed + env_failed + engine_failed + worker_failed +
cancelled + running; a group the trainer never took (queued or running when the run ends, or in flight at a
checkpoint a resume starts from) has its ended-well episodes counted cancelled, so ``accepted`` counts the
episodes trained. Env failures (`EnvError`), engine failures (`EngineError`) and lost rollout workers
(`WorkerLostError`, on a cluster) are retried up to ``max_retries`` times; other exceptions are
policy/agent failures and are not retried. A `RunHalted` stops the run (`get_batch` raises it): one an
episode raised (a `ClusterError`: the cluster cannot recover; an env server's 4xx: the run's own mistake),
or the controller's own when more than ``max_failed_fraction`` of the episodes that ended since the batch
began failed after their retries (counted once a batch's worth has ended): a run that cannot make
progress stops instead of spinning through failing episodes.

A group is consumed when it leaves for good: handed to the trainer, rejected by the filter, dropped
(every episode failed) or stale. `cursor` says where the run stands in its prompts (the lowest unconsumed
index, the consumed ones above it, the groups in flight with their submission version): a checkpoint
records it, and a controller built with ``start_index`` and ``consumed`` from it submits exactly the groups
not yet consumed, in index order, so a resume at any staleness trains each group once.

Episodes run in this process (``agent.run_episode(make_env(), ...)``) unless ``run_episode`` is given:
the Ray launcher passes one that runs them on rollout worker actors, so the gate and the ledger stay here.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field

from areal_agents.agents.base import Agent
from areal_agents.envs.async_env import AsyncEnv
from areal_agents.errors import RunHalted
from areal_agents.progress import plural
from areal_agents.rollout.episodes import EpisodeFn, EpisodeRunner, RolloutLedger, local_episode
from areal_agents.rollout.failures import Cause, FailureLog
from areal_agents.timeline import timeline
from areal_agents.types import Trajectory

log = logging.getLogger(__name__)


@dataclass
class Group:
    """The episodes of one prompt (prompt ``index`` of the run), with the policy version at submission."""

    group_id: str
    index: int
    seed: int
    trajectories: list[Trajectory]
    submit_version: int
    episodes: int = 0  # episodes that finished (a failed one leaves the group smaller)


@dataclass(frozen=True)
class DataCursor:
    """Where a run stands in its prompts: what a checkpoint records and a resumed controller starts from.

    Every index below ``position`` is consumed, and so are those in ``consumed`` (sorted; at most the groups
    submitted since the oldest one still in flight). ``in_flight`` maps each index submitted and not consumed
    to the policy version it was submitted at; ``in_flight_accepted`` counts their episodes that had ended
    well (a resume runs those groups again, so the kill cancelled that work)."""

    position: int = 0
    consumed: tuple[int, ...] = ()
    in_flight: dict[int, int] = field(default_factory=dict)
    in_flight_accepted: int = 0

    def describe(self) -> str:
        """One line for a resume, e.g. ``from prompt 8 (2 consumed ahead of it; 3 groups in flight, submitted at
        versions 2-3, run again)``."""
        parts = [f"{len(self.consumed)} consumed ahead of it"] if self.consumed else []
        if self.in_flight:
            low, high = min(self.in_flight.values()), max(self.in_flight.values())
            at = f"version {low}" if low == high else f"versions {low}-{high}"
            parts.append(f"{plural(len(self.in_flight), 'group')} in flight, submitted at {at}, run again")
        return f"from prompt {self.position}" + (f" ({'; '.join(parts)})" if parts else "")


def has_reward_variance(group: Group) -> bool:
    """Dynamic sampling's filter (``group_filter``): a group whose rewards are all equal teaches GRPO nothing."""
    return len({t.reward for t in group.trajectories}) > 1


@dataclass
class ControllerStats:
    groups_submitted: int = 0
    groups_accepted: int = 0
    groups_rejected: int = 0
    groups_dropped: int = 0  # every episode of the group failed
    groups_stale: int = 0  # finished too late: older than max_staleness when its batch was formed
    staleness: list[int] = field(default_factory=list)  # per consumed trajectory: version now - oldest token


def capacity(
    max_concurrent: int, running: int, max_staleness: int, version: int, batch_size: int, accepted: int
) -> int:
    """How many more groups may be submitted now (never negative)."""
    return max(0, min(max_concurrent - running, (max_staleness + version + 1) * batch_size - (accepted + running)))


class RolloutController:
    """Produce groups of episodes concurrently; hand out batches of ``batch_size`` groups."""

    def __init__(
        self,
        agent: Agent,
        make_env: Callable[[], AsyncEnv],
        seed_at: Callable[[int], int],
        *,
        batch_size: int,
        group_size: int,
        get_version: Callable[[], int],
        max_staleness: int = 0,
        max_concurrent_episodes: int = 256,
        group_filter: Callable[[Group], bool] | None = None,
        max_retries: int = 1,
        ledger: RolloutLedger | None = None,
        tag: str = "",
        start_index: int = 0,
        consumed: Iterable[int] = (),
        groups_before: int = 0,
        run_episode: EpisodeFn | None = None,
        max_failed_fraction: float = 1.0,
        failures: FailureLog | None = None,
    ) -> None:
        """``max_concurrent_episodes`` counts episodes still running, not their groups: a group whose other
        episodes have ended holds one place, not ``group_size``, so a long answer does not keep the engine
        underfull. ``start_index``, ``consumed`` and ``groups_before`` continue a resumed run (`DataCursor`): its
        first unconsumed prompt, the prompts above it already consumed (never submitted again), and the groups
        it had trained on (the capacity gate counts from the start of the run)."""
        if max_concurrent_episodes < group_size:
            raise ValueError(
                f"max_concurrent_episodes: expects at least group_size ({group_size}), got {max_concurrent_episodes}"
            )
        self.seed_at = seed_at
        self.batch_size, self.group_size = batch_size, group_size
        self.get_version = get_version
        self.max_staleness, self.max_concurrent_episodes = max_staleness, max_concurrent_episodes
        self.group_filter = group_filter
        self.ledger = ledger if ledger is not None else RolloutLedger()
        self.tag = tag
        self.stats = ControllerStats(groups_accepted=groups_before)
        self.running_groups = 0
        self.running_episodes = 0
        self._ready: list[tuple[int, Group]] = []  # a heap by submission order
        self._ready_event: asyncio.Event | None = None
        self._wakeup: asyncio.Event | None = None
        self._producer: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._paused = False
        self._skip = {i for i in consumed if i >= start_index}  # consumed before a resume, not yet passed
        self._next_index = start_index  # prompt i is seed_at(i): the data order is a pure function of i
        self._advance_past_skipped()
        self._unconsumed: dict[int, int] = {}  # submitted, not yet handed to the trainer (or dropped): its version
        self._ended_well: Counter[int] = Counter()  # per unconsumed group: its episodes that ended accepted
        self._episode = run_episode or local_episode(agent, make_env)
        self.failures = failures if failures is not None else FailureLog()
        # the one count of retries: runner.retries, runner.worker_retries (an episode re-run as its worker died)
        self.runner = EpisodeRunner(self.ledger, max_retries=max_retries, failures=self.failures)
        self.max_failed_fraction = max_failed_fraction
        self._window: tuple[int, int, Counter[Cause]] | None = None  # ended, failed, causes when the batch began
        self._fatal: BaseException | None = None
        tl = timeline()  # the queues, sampled every bin of the run's timeline
        tl.gauge("rollout/queued_groups", lambda: self.queued_groups)
        tl.gauge("rollout/running_groups", lambda: self.running_groups)
        tl.gauge("rollout/episodes_running", lambda: self.running_episodes)

    # ---- consumer side ------------------------------------------------------------------------

    async def get_batch(self) -> list[Group]:
        """The next ``batch_size`` accepted groups (see `stream_batch`), in prompt order."""
        return sorted([group async for group in self.stream_batch()], key=lambda g: g.index)

    async def stream_batch(self) -> AsyncIterator[Group]:
        """The next ``batch_size`` accepted groups, each as soon as it may be taken (oldest finished
        first), so a trainer can start on them while the rest finish; a group submitted ``max_staleness``
        versions ago is waited for (see `_may_take`). A group whose oldest token is still more than
        ``max_staleness`` versions behind the policy (servers that report other versions) is rejected as
        stale and replaced.
        """
        self._start()
        self._window = (self.ledger.ended, self.ledger.failures, self.failures.totals.copy())
        taken: list[Group] = []
        version = self.get_version()
        stale_run = 0
        while len(taken) < self.batch_size:
            while self._fatal is not None or not self._ready or not self._may_take(len(taken), version):
                if self._fatal is not None:
                    raise self._fatal
                self._ready_event.clear()
                await self._ready_event.wait()
            index, group = heapq.heappop(self._ready)
            self._consume(index)
            if _staleness(group.trajectories, version) > self.max_staleness:
                self.stats.groups_stale += 1
                stale_run += 1
                if stale_run == 4 * self.batch_size:  # more than overtaking can explain
                    log.warning(
                        "%d groups in a row were older than max_staleness=%d (trainer version %d): do the "
                        "model servers report the trainer's weight versions?",
                        stale_run, self.max_staleness, version,
                    )  # fmt: skip
                self.stats.groups_accepted -= 1  # the gate lets a replacement in
                self.ledger.reject(group.episodes)
                self._wakeup.set()
                continue
            taken.append(group)
            stale_run = 0
            self.stats.staleness += [_staleness([t], version) for t in group.trajectories]
            yield group
        self._wakeup.set()

    def _may_take(self, taken: int, version: int) -> bool:
        """Whether the batch may take the oldest finished group now. A group submitted at version ``s`` must
        be trained by version ``s + max_staleness``: a younger group may take a place only if the groups due
        in each of the next batches still fit in them. Otherwise the slow groups (long answers), overtaken
        by younger ones, would be the ones dropped as stale: a bias toward short answers, and compute lost."""
        first = self._unconsumed.get(self._ready[0][0], version)
        for ahead in range(self.max_staleness + 1):  # the groups due in this batch and the next ``ahead``
            due = version - self.max_staleness + ahead
            if first > due:
                pending = sum(v <= due for v in self._unconsumed.values())
                if taken + 1 + pending > (ahead + 1) * self.batch_size:
                    return False
        return True

    @property
    def data_position(self) -> int:
        """The first prompt index not yet consumed: a resumed run restarts from here (same data order)."""
        return min(self._unconsumed, default=self._next_index)

    @property
    def cursor(self) -> DataCursor:
        """Where the run stands in its prompts now (a copy): what a checkpoint records (`DataCursor`)."""
        position = self.data_position
        consumed = [i for i in range(position + 1, self._next_index) if i not in self._unconsumed]
        return DataCursor(
            position,
            tuple(consumed + sorted(self._skip)),
            dict(sorted(self._unconsumed.items())),
            sum(self._ended_well[i] for i in self._unconsumed),
        )

    @property
    def queued_groups(self) -> int:
        return len(self._ready)

    def pause(self) -> None:
        """Submit nothing new (episodes in flight carry on) until `resume`."""
        self._paused = True

    def resume(self) -> None:
        self._paused = False
        if self._wakeup is not None:
            self._wakeup.set()

    def notify_version(self) -> None:
        """The policy version changed: the gate may have opened."""
        if self._wakeup is not None:
            self._wakeup.set()

    async def aclose(self) -> None:
        """Stop producing and cancel the episodes in flight; the ledger counts them as cancelled, and so the
        ended-well episodes of every group the trainer did not take (queued, or cut off mid-group)."""
        tasks = [t for t in (self._producer, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._producer = None
        self.ledger.cancel(sum(self._ended_well[i] for i in self._unconsumed))
        self._ended_well.clear()

    # ---- producer side ------------------------------------------------------------------------

    def capacity(self) -> int:
        """Groups the gate lets in now (accepted counts every group accepted so far, queued or consumed).
        The concurrency term is in places for whole groups: free episode places // group_size."""
        free = (self.max_concurrent_episodes - self.running_episodes) // self.group_size
        return capacity(
            self.running_groups + free, self.running_groups, self.max_staleness, self.get_version(),
            self.batch_size, self.stats.groups_accepted,
        )  # fmt: skip

    def _start(self) -> None:
        if self._producer is None:
            self._ready_event = asyncio.Event()
            self._wakeup = asyncio.Event()
            self._producer = asyncio.ensure_future(self._produce())

    async def _produce(self) -> None:
        while True:
            n = 0 if self._paused or self._fatal is not None else self.capacity()
            for _ in range(n):
                self.running_groups += 1
                self.running_episodes += self.group_size
                self.stats.groups_submitted += 1
                index = self._next_index
                self._next_index += 1
                self._advance_past_skipped()
                self._unconsumed[index] = self.get_version()
                task = asyncio.ensure_future(self._run_group(index, self._unconsumed[index]))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            self._wakeup.clear()
            await self._wakeup.wait()

    def _advance_past_skipped(self) -> None:
        """The next index to submit skips those a resumed run had consumed."""
        while self._next_index in self._skip:
            self._skip.discard(self._next_index)
            self._next_index += 1

    def _consume(self, index: int) -> None:
        """Group ``index`` left for good (taken, rejected, dropped or stale)."""
        self._unconsumed.pop(index, None)
        self._ended_well.pop(index, None)

    async def _run_group(self, index: int, version: int) -> None:
        seed = self.seed_at(index)
        group_id = f"{self.tag}g{index}-{seed}"
        episodes = [self._run_episode(index, seed, f"{group_id}/e{k}") for k in range(self.group_size)]
        try:
            results = [ts for ts in await asyncio.gather(*episodes) if ts is not None]
        except RunHalted as e:
            self._fatal = self._fatal or e  # get_batch raises it
            self._ready_event.set()
            return
        finally:
            self.running_groups -= 1
        group = Group(group_id, index, seed, [t for ts in results for t in ts], version, len(results))
        for t in group.trajectories:
            t.group_id = group_id
        if group.episodes == 0:
            self.stats.groups_dropped += 1
            self._consume(index)
        elif self.group_filter is not None and not self.group_filter(group):
            self.stats.groups_rejected += 1
            self._consume(index)
            self.ledger.reject(group.episodes)
        else:
            self.stats.groups_accepted += 1
            heapq.heappush(self._ready, (index, group))
        self._ready_event.set()  # a group finished, or left: get_batch may take one, or stop waiting for it
        self._wakeup.set()

    async def _run_episode(self, index: int, seed: int, episode_id: str) -> list[Trajectory] | None:
        try:
            trajectories = await self.runner.run(lambda: self._episode(seed, episode_id), episode_id)
            self._ended_well[index] += trajectories is not None
            return trajectories
        finally:
            self.running_episodes -= 1
            self._check_failures()
            self._wakeup.set()  # its place is free: another group may fit

    def _check_failures(self) -> None:
        """Halt the run (`get_batch` raises) when more than ``max_failed_fraction`` of the episodes that ended
        since the batch began failed after their retries, once a batch's worth of episodes has ended."""
        if self._fatal is not None or self._window is None:
            return
        ended, failed = self.ledger.ended - self._window[0], self.ledger.failures - self._window[1]
        if ended < self.batch_size * self.group_size or failed <= self.max_failed_fraction * ended:
            return
        self.failures.flush()
        causes = self.failures.describe(self.failures.since(self._window[2]))
        self._fatal = RunHalted(
            f"rollout: {failed} of the last {ended} episodes failed after their retries (more than "
            f"rollout.max_failed_fraction={self.max_failed_fraction:g}): {causes}"
        )
        self._ready_event.set()


def _staleness(trajectories: list[Trajectory], version: int) -> int:
    """Versions between the policy now and the oldest generated token of ``trajectories``."""
    versions = [v for t in trajectories for v in t.versions if v >= 0]
    return version - min(versions) if versions else 0

"""`GatewaySource`: the trainer's batches from live traffic (``rollout.source=gateway``): ``batch_size`` rewarded
sessions a step, in the order their rewards came, each a group of its own (or of its task key's sessions).

It answers the trainer what a `RolloutController` does (``get_batch``, ``stream_batch``, ``cursor``, ``stats``)
without producing anything itself: the clients do. A session whose oldest token is more than ``max_staleness``
versions behind when it is taken is dropped (``gateway.stale_sessions=drop``, counted as rejected) or trained
with the decoupled loss's behavior-ratio correction (``correct``).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from areal_agents.rollout.controller import ControllerStats, DataCursor, Group
from areal_agents.rollout.episodes import RolloutLedger
from areal_agents.rollout.gateway.session_book import FinishedSession


@dataclass
class NoRetries:
    """Gateway sessions are the clients' to retry: the counts a run's summary reads stay 0."""

    retries: int = 0
    worker_retries: int = 0


class GatewaySource:
    """Rewarded sessions queued by `put` (the gateway's ``on_ready``), taken ``batch_size`` at a time."""

    def __init__(
        self,
        batch_size: int,
        get_version: Callable[[], int],
        *,
        max_staleness: int,
        stale_sessions: str = "drop",
        ledger: RolloutLedger | None = None,
        replay: Iterable[FinishedSession] = (),
        taken_before: int = 0,
    ) -> None:
        if stale_sessions not in ("drop", "correct"):
            raise ValueError(f"stale_sessions: expects 'drop' or 'correct', got {stale_sessions!r}")
        self.batch_size, self.get_version = batch_size, get_version
        self.max_staleness, self.stale_sessions = max_staleness, stale_sessions
        self.ledger = ledger if ledger is not None else RolloutLedger()
        self.stats = ControllerStats()
        self.runner = NoRetries()
        self.running_groups = 0  # the open sessions are the gateway's (rollout/gateway_open_sessions)
        self.taken = taken_before
        self.replayed = 0
        self._ready: deque[FinishedSession] = deque()
        self.quiet_s = 60.0  # a line is printed after this long without a rewarded session
        self._arrived: asyncio.Event | None = None
        for session in replay:
            self.put(session, replayed=True)

    def put(self, session: FinishedSession, replayed: bool = False) -> None:
        """A rewarded session is ready for training."""
        self.ledger.submitted += 1  # the ledger counts sessions that reached the trainer (the gateway: all others)
        self.ledger.accepted += 1
        self.replayed += replayed
        self._ready.append(session)
        if self._arrived is not None:
            self._arrived.set()

    @property
    def queued_groups(self) -> int:
        return len(self._ready)

    @property
    def cursor(self) -> DataCursor:
        """Sessions taken so far (live traffic is not replayed on a resume: the clients' sessions are gone)."""
        return DataCursor(self.taken)

    async def get_batch(self) -> list[Group]:
        return [group async for group in self.stream_batch()]

    async def stream_batch(self) -> AsyncIterator[Group]:
        """The next ``batch_size`` sessions, each as it is rewarded; stale ones dropped or kept, by config."""
        if self._arrived is None:
            self._arrived = asyncio.Event()
        version, taken = self.get_version(), 0
        while taken < self.batch_size:
            while not self._ready:
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), self.quiet_s)
                except TimeoutError:  # live traffic may pause: say so, and wait on
                    print(self.waiting_line(taken), flush=True)
            session = self._ready.popleft()
            staleness = version - session.oldest_version if session.oldest_version >= 0 else 0
            if staleness > self.max_staleness and self.stale_sessions == "drop":
                self.stats.groups_stale += 1
                self.ledger.reject(1)
                continue
            taken += 1
            self.taken += 1
            self.stats.groups_accepted += 1
            self.stats.staleness += [staleness] * len(session.trajectories)
            yield Group(
                session.trajectories[0].group_id, self.taken, 0, session.trajectories, session.oldest_version, 1
            )

    def waiting_line(self, taken: int) -> str:
        return f"gateway: waiting for rewarded sessions ({taken} of {self.batch_size} for this step)"

    def pause(self) -> None:
        """Nothing to pause: live traffic keeps flowing (the gateway serves until the run stops)."""

    def notify_version(self) -> None:
        """Staleness is judged when a session is taken: nothing waits on the version."""

    async def aclose(self) -> None:
        """Sessions rewarded and never trained end as cancelled."""
        self.ledger.cancel(len(self._ready))
        self._ready.clear()

"""The futures behind every asynchronous Tinker call: submit a job, get a request id, long-poll its result.

Jobs of one queue (a training model id) run one at a time in arrival order, which is the SDK's ``seq_id``
order while ``parallel_fwdbwd_chunks`` is off: an ``optim_step`` posted before its ``forward_backward``
finished runs after it. Jobs without a queue (sampling) run at once, side by side. ``retrieve`` holds the
poll until the result is ready or ``wait_s`` passed: the SDK polls again at once, with no sleep, after a
``try_again``, so answering it early would spin the client in a hot loop.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from areal_agents.errors import ArealAgentsError, RequestError

log = logging.getLogger(__name__)
Job = Callable[[], Any]  # a plain function (run in a thread; a coroutine it returns is awaited), or a coroutine


class TryAgain:
    """The marker `retrieve` returns when the result was not ready within ``wait_s``."""

    def __repr__(self) -> str:
        return "TRY_AGAIN"


TRY_AGAIN = TryAgain()


class StoreFull(ArealAgentsError):
    """More requests are pending than the store holds; the client should send this one again later."""


@dataclass(frozen=True)
class FailedRequest:
    """A request that failed while running: ``user`` when the client sent something wrong, else ``server``."""

    error: str
    category: Literal["user", "server"]

    def to_json(self) -> dict[str, str]:
        """The body the SDK reads as ``RequestFailedResponse`` (it raises ``RequestFailedError``)."""
        return {"error": self.error, "category": self.category}


def failure_of(exc: BaseException) -> FailedRequest:
    """A job's exception as a failed request: `RequestError` (fields named) is the user's, anything else ours."""
    if isinstance(exc, RequestError):
        return FailedRequest(str(exc), "user")
    return FailedRequest(f"internal error: {type(exc).__name__}: {exc}", "server")


@dataclass
class _Entry:
    owner: str
    done: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: Any = None
    fetched_at: float | None = None


class FutureStore:
    """Request id -> pending, result or `FailedRequest`; results stay until fetched (plus a grace) or dropped.

    Example:
        store = FutureStore()
        rid = store.submit(lambda: {"ok": 1}, owner="sess", queue="sess:train:0")
        result = await store.retrieve(rid, wait_s=30)
    """

    def __init__(self, max_pending: int = 10_000, keep_fetched_s: float = 120.0):
        self.max_pending = max_pending
        self.keep_fetched_s = keep_fetched_s  # a lost reply can be polled again this long
        self._entries: dict[str, _Entry] = {}
        self._queues: dict[str, deque[tuple[str, Job]]] = {}
        self._tasks: set[asyncio.Task] = set()
        self._ids = itertools.count(1)

    def submit(self, job: Job, owner: str, queue: str | None = None) -> str:
        """Schedule ``job`` for ``owner`` (a session id) and return its request id; call in the event loop."""
        self._forget_fetched()
        pending = sum(not e.done.is_set() for e in self._entries.values())
        if pending >= self.max_pending:
            _close(job)
            raise StoreFull(f"{pending} requests are pending (the most this server holds): send it again later")
        request_id = f"req-{next(self._ids)}"
        self._entries[request_id] = _Entry(owner)
        if queue is None:
            self._spawn(self._run(request_id, job))
        elif queue in self._queues:
            self._queues[queue].append((request_id, job))
        else:
            self._queues[queue] = deque([(request_id, job)])
            self._spawn(self._drain(queue))
        return request_id

    async def retrieve(self, request_id: str, wait_s: float) -> Any:
        """The job's result or `FailedRequest`, or `TRY_AGAIN` after ``wait_s``; KeyError for an unknown id."""
        if wait_s <= 0:
            raise ValueError(f"wait_s: expects > 0 (an instant try_again makes the SDK spin), got {wait_s}")
        entry = self._entries[request_id]
        try:
            await asyncio.wait_for(entry.done.wait(), wait_s)
        except TimeoutError:
            return TRY_AGAIN
        if entry.fetched_at is None:
            entry.fetched_at = time.monotonic()
        return entry.outcome

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    def drop_owner(self, owner: str) -> int:
        """Forget every request of ``owner`` (its session ended); queued ones never run. Returns how many."""
        ids = [rid for rid, e in self._entries.items() if e.owner == owner]
        for rid in ids:
            del self._entries[rid]
        return len(ids)

    async def close(self) -> None:
        """Cancel every running job's task and wait for them (the server is shutting down)."""
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain(self, queue: str) -> None:
        """Run one queue's jobs in order until it is empty, then let it go."""
        jobs = self._queues[queue]
        try:
            while jobs:
                request_id, job = jobs.popleft()
                await self._run(request_id, job)
        finally:
            for _, job in self._queues.pop(queue, ()):
                _close(job)

    async def _run(self, request_id: str, job: Job) -> None:
        """Run one job unless its request was dropped; keep its result or its failure."""
        if request_id not in self._entries:
            _close(job)
            return
        try:
            outcome = await _call(job)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # any failure becomes the request's answer, never the server's
            if not isinstance(exc, RequestError):
                log.exception("tinker request %s failed", request_id)
            outcome = failure_of(exc)
        entry = self._entries.get(request_id)
        if entry is not None:
            entry.outcome = outcome
            entry.done.set()

    def _forget_fetched(self) -> None:
        """Drop results fetched longer than ``keep_fetched_s`` ago."""
        cutoff = time.monotonic() - self.keep_fetched_s
        old = [rid for rid, e in self._entries.items() if e.fetched_at is not None and e.fetched_at < cutoff]
        for rid in old:
            del self._entries[rid]


async def _call(job: Job) -> Any:
    """Await a coroutine (function); run a plain function in a thread so the loop keeps serving polls."""
    if inspect.iscoroutine(job):
        return await job
    if inspect.iscoroutinefunction(job):
        return await job()
    result = await asyncio.to_thread(job)
    return await result if inspect.iscoroutine(result) else result  # a lambda that makes a coroutine


def _close(job: Job) -> None:
    """Close a coroutine that will never run (no 'never awaited' warning)."""
    if inspect.iscoroutine(job):
        job.close()

"""`RewardService`: rewards off the event loop, in worker processes, with a hard per-call timeout.

    service = RewardService(workers=2, timeout=10.0)
    result = await service.score(MathReward(), completion, row)        # RewardResult
    results = await service.score_batch(MathReward(), [(completion, row), ...])

A call that overruns the timeout has its worker killed and replaced; its reward is 0 with details
``{"error": "timeout"}``. A reward function that raises gives 0 with ``{"error": "reward_error"}``.
Batches go to workers in chunks (one round trip each); a chunk that times out is retried item by item,
so only the slow item loses (it waits at most twice the timeout). Async reward functions run on the event
loop with the same timeout. An item whose worker died is tried once more in a new worker before it scores 0
with ``{"error": "worker_died"}``. The workers never import the caller's ``__main__``: a reward function (or
``initializer``) defined there is refused with `WorkerImportError` naming it, and a worker that cannot start
raises `WorkerStartError`; neither is ever a score.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from areal_agents.rewards.base import RewardFunction, RewardResult, as_result
from areal_agents.timeline import timeline
from areal_agents.workers import CallTimeout, RemoteError, WorkerDied, WorkerPool


def _score_chunk(fn: RewardFunction, items: list[tuple[str, dict]]) -> list[tuple[float, dict] | tuple[None, str]]:
    out: list[Any] = []
    for completion, row in items:
        try:
            r = as_result(fn(completion, row))
            out.append((r.reward, r.details))
        except Exception as e:  # one bad item does not fail its chunk
            out.append((None, f"{type(e).__name__}: {e}"))
    return out


class RewardService:
    """A pool of ``workers`` processes scoring completions; counters and latency percentiles in `metrics`.

    Latency is per worker round trip (a chunk of up to ``chunk_size`` items), as a caller waits for it.
    """

    def __init__(
        self,
        workers: int = 2,
        timeout: float = 10.0,
        chunk_size: int = 64,
        initializer: Callable[[], Any] | None = None,
    ) -> None:
        self.timeout, self.chunk_size = timeout, chunk_size
        self.workers = workers
        self.pool = WorkerPool(workers, initializer=initializer, name="reward-service")
        self.counters: collections.Counter[str] = collections.Counter()
        self.latencies: collections.deque[float] = collections.deque(maxlen=10_000)
        self.in_flight = 0  # completions being scored
        timeline().idle("reward/service")
        timeline().gauge("reward/in_flight", lambda: self.in_flight)

    async def score(self, fn: RewardFunction, completion: str, row: dict[str, Any]) -> RewardResult:
        return (await self.score_batch(fn, [(completion, row)]))[0]

    async def score_batch(self, fn: RewardFunction, items: Sequence[tuple[str, dict[str, Any]]]) -> list[RewardResult]:
        self.in_flight += len(items)
        try:
            with timeline().busy("reward/service"):
                return await self._score_batch(fn, items)
        finally:
            self.in_flight -= len(items)

    async def _score_batch(self, fn: RewardFunction, items: Sequence[tuple[str, dict[str, Any]]]) -> list[RewardResult]:
        if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__):
            results = await asyncio.gather(*(self._score_async(fn, c, r) for c, r in items))
        else:
            # ~4 chunks per worker: few round trips for cheap items, still balanced for slow ones.
            size = max(1, min(self.chunk_size, -(-len(items) // (4 * self.workers))))
            chunks = [list(items[i : i + size]) for i in range(0, len(items), size)]
            nested = await asyncio.gather(*(self._score_chunk(fn, chunk) for chunk in chunks))
            results = [r for chunk in nested for r in chunk]
        self.counters["calls"] += len(items)
        return results

    async def _score_async(self, fn: Any, completion: str, row: dict) -> RewardResult:
        start = time.perf_counter()
        try:
            async with asyncio.timeout(self.timeout):
                result = as_result(await fn(completion, row))
            self.latencies.append(time.perf_counter() - start)
            return result
        except TimeoutError:
            self.counters["timeouts"] += 1
            return RewardResult(0.0, {"error": "timeout"})
        except Exception as e:
            self.counters["errors"] += 1
            return RewardResult(0.0, {"error": "reward_error", "message": f"{type(e).__name__}: {e}"})

    async def _score_chunk(
        self, fn: RewardFunction, chunk: list[tuple[str, dict]], tried: bool = False
    ) -> list[RewardResult]:
        """Score ``chunk`` in one worker call; ``tried``: its item failed once already (alone or in a chunk)."""
        start = time.perf_counter()
        try:
            raw = await self.pool.call(_score_chunk, fn, chunk, timeout=self.timeout)
        except (CallTimeout, WorkerDied, RemoteError) as e:
            if len(chunk) > 1:  # find the slow or fatal item: retry one by one
                return [r for item in chunk for r in await self._score_chunk(fn, [item], tried=True)]
            if isinstance(e, WorkerDied) and not tried:  # killed from outside, or by this item: once more
                return await self._score_chunk(fn, chunk, tried=True)
            kind = {CallTimeout: "timeout", WorkerDied: "worker_died", RemoteError: "reward_error"}[type(e)]
            self.counters["timeouts" if kind == "timeout" else "errors"] += 1
            return [RewardResult(0.0, {"error": kind, "message": str(e)})]
        self.latencies.extend([time.perf_counter() - start] * len(chunk))  # one round trip per chunk
        out = []
        for reward, details in raw:
            if reward is None:
                self.counters["errors"] += 1
                out.append(RewardResult(0.0, {"error": "reward_error", "message": details}))
            else:
                out.append(RewardResult(reward, details))
        return out

    def metrics(self) -> dict[str, float]:
        lat = np.array(self.latencies) * 1000 if self.latencies else np.zeros(1)
        return {
            "calls": float(self.counters["calls"]),
            "timeouts": float(self.counters["timeouts"]),
            "errors": float(self.counters["errors"]),
            "latency_p50_ms": float(np.percentile(lat, 50)),
            "latency_p99_ms": float(np.percentile(lat, 99)),
            "worker_restarts": float(self.pool.stats.restarts),
        }

    async def aclose(self) -> None:
        self.pool.close()

"""Interruptible generation, as every engine does it (AReaL's partial rollout): a weight update pauses
generation (`update_pause`), in-flight requests come back ``abort`` with their tokens so far, and
`generate_to_end` resubmits prompt + tokens so far with the budget left once the engine resumes
(`ResumeGate`: waiters wake on resume, nothing polls).

    gate = ResumeGate()
    response = await generate_to_end(request, submit_once, gate)   # in agenerate
    async with update_pause(gate, pause, resume):                   # in a weight update
        load_weights(); set_version()
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from areal_agents.timeline import timeline
from areal_agents.types import GenRequest, GenResponse


class ResumeGate:
    """Paused or not; `wait` returns once not paused. Its event is made for the running loop (a second
    ``asyncio.run`` gets a fresh one), and `resume` may be called from any thread (an engine closing)."""

    def __init__(self) -> None:
        self.paused = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def pause(self) -> None:
        """Paused: `wait` sleeps until `resume`."""
        self.paused = True
        if self._event is not None:
            self._event.clear()

    def resume(self) -> None:
        """Not paused: wake every waiter (from this loop's thread or another)."""
        self.paused = False
        loop, event = self._loop, self._event
        if loop is None or event is None or loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            event.set()
        else:
            loop.call_soon_threadsafe(event.set)

    async def wait(self) -> None:
        if not self.paused:
            return
        loop = asyncio.get_running_loop()
        if self._loop is not loop or self._event is None:
            self._loop, self._event = loop, asyncio.Event()
        if self.paused:
            await self._event.wait()


async def generate_to_end(
    request: GenRequest, submit_once: Callable[[GenRequest], Awaitable[GenResponse]], gate: ResumeGate
) -> GenResponse:
    """``request`` generated to its end: after every ``abort`` part, wait for ``gate`` and resubmit prompt +
    tokens so far with the tokens left; the parts' tokens, logprobs and versions joined (``abort`` with
    nothing left to generate ends as ``length``)."""
    start, budget = time.perf_counter(), request.sampling.max_new_tokens
    tokens: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    with timeline().span("episodes", "generate", rid=request.rid, prompt_tokens=len(request.input_ids)) as span:
        while True:
            await gate.wait()
            left = dataclasses.replace(request.sampling, max_new_tokens=budget - len(tokens))
            part = await submit_once(GenRequest(request.rid, request.input_ids + tokens, left, request.lora_name))
            tokens += part.output_tokens
            logprobs += part.output_logprobs
            versions += part.output_versions
            if part.stop_reason != "abort" or len(tokens) >= budget:
                reason = part.stop_reason if part.stop_reason != "abort" else "length"
                span.update(tokens=len(tokens), stop_reason=reason, versions=sorted(set(versions)))
                return GenResponse(tokens, logprobs, versions, reason, time.perf_counter() - start)


@asynccontextmanager
async def update_pause(
    gate: ResumeGate, pause: Callable[[], Awaitable[None]], resume: Callable[[], Awaitable[None]]
) -> AsyncIterator[None]:
    """``pause()`` for the body of a weight update (load, then the version), ``resume()`` after it, also when
    it fails, unless the engine was paused before (its caller's pause holds)."""
    was_paused = gate.paused
    await pause()
    try:
        yield
    finally:
        if not was_paused:
            await resume()

"""The interruptible-generation pieces every engine shares: the resume gate, the resubmit loop, the update pause."""

import asyncio
import threading

import pytest

from areal_agents.engines.interruptible import ResumeGate, generate_to_end, update_pause
from areal_agents.types import GenRequest, GenResponse, SamplingParams


def test_a_waiter_wakes_on_resume_and_not_before():
    async def run():
        gate = ResumeGate()
        await gate.wait()  # not paused: returns at once
        gate.pause()
        waiter = asyncio.create_task(gate.wait())
        await asyncio.sleep(0.05)
        assert not waiter.done()
        gate.resume()
        await asyncio.wait_for(waiter, 1)

    asyncio.run(run())
    asyncio.run(run())  # a second event loop: the gate makes its event anew


def test_a_resume_from_another_thread_wakes_the_waiter():
    async def run():
        gate = ResumeGate()
        gate.pause()
        waiter = asyncio.create_task(gate.wait())
        await asyncio.sleep(0.01)
        threading.Thread(target=gate.resume).start()  # an engine closed from another thread
        await asyncio.wait_for(waiter, 1)

    asyncio.run(run())


def test_parts_are_joined_and_each_resubmission_asks_for_the_tokens_left():
    seen = []
    parts = iter([([5, 6], "abort"), ([7], "abort"), ([8], "stop")])

    async def submit_once(request: GenRequest) -> GenResponse:
        seen.append((request.input_ids, request.sampling.max_new_tokens))
        tokens, reason = next(parts)
        return GenResponse(tokens, [-0.5] * len(tokens), [len(seen)] * len(tokens), reason)

    request = GenRequest("r", [1, 2], SamplingParams(max_new_tokens=10))
    response = asyncio.run(generate_to_end(request, submit_once, ResumeGate()))
    assert seen == [([1, 2], 10), ([1, 2, 5, 6], 8), ([1, 2, 5, 6, 7], 7)]
    assert response.output_tokens == [5, 6, 7, 8] and response.output_versions == [1, 1, 2, 3]
    assert response.stop_reason == "stop"


def test_an_abort_with_no_tokens_left_ends_as_length():
    async def submit_once(request: GenRequest) -> GenResponse:
        return GenResponse([9] * request.sampling.max_new_tokens, [0.0] * 3, [0] * 3, "abort")

    request = GenRequest("r", [1], SamplingParams(max_new_tokens=3))
    response = asyncio.run(generate_to_end(request, submit_once, ResumeGate()))
    assert response.output_tokens == [9, 9, 9] and response.stop_reason == "length"


def test_update_pause_resumes_after_a_failed_load_unless_paused_before():
    calls = []
    gate = ResumeGate()

    async def pause():
        calls.append("pause")
        gate.pause()

    async def resume():
        calls.append("resume")
        gate.resume()

    async def update(fail: bool):
        async with update_pause(gate, pause, resume):
            if fail:
                raise RuntimeError("bad weights")

    with pytest.raises(RuntimeError):
        asyncio.run(update(fail=True))
    assert calls == ["pause", "resume"] and not gate.paused
    calls.clear()
    gate.pause()  # the caller's own pause holds through the update
    asyncio.run(update(fail=False))
    assert calls == ["pause"] and gate.paused
